"""SmolLM2-135M end to end: a fact survives 15 turns while acknowledgements are labelled to go; both
protocol modes run."""

import pytest
from whitespace_cases import WHITESPACE_MESSAGES

from clm_middleware.conversation import Conversation
from clm_middleware.lifecycle.segments import DecidedBy, Label, Status

TURNS = [
    "Hi, I need help with a delivery. My order number is 48213-KX and it has not arrived yet.",
    "ok thanks",
    "Can you tell me how parcel tracking usually works?",
    "cool",
    "What should I do if the courier left a note but I was home?",
    "great, thanks",
    "How long do deliveries usually take within the same country?",
    "ok",
    "Is it normal for tracking to stop updating for a few days?",
    "thanks!",
    "What information should I have ready when I call support?",
    "got it",
    "Should I ask for a refund or a replacement in your opinion?",
    "ok thanks",
    "Please remind me: what was my order number?",
]


@pytest.mark.parametrize("tagging", ["free", "constrained"])
def test_fact_from_turn_one_is_in_context_at_turn_fifteen_while_acks_are_labelled_to_go(smol_engine, tagging):
    conversation = Conversation(
        smol_engine,
        tagging=tagging,
        max_new_tokens=16,
        system_prompt="You are a helpful support agent.",
    )
    try:
        replies = [conversation.send(text) for text in TURNS]
        assert "48213-KX" in conversation.context
        user_acks = [s for s in conversation.segments if s.role == "user" and s.kind == "ack"]
        assert len(user_acks) == 7
        dropped = sum(s.status is Status.DROPPED for s in user_acks)
        parsed = [r.stats.parse_ok for r in replies if r.stats.parse_ok is not None]
        if tagging == "free":
            # reported, not assumed: SmolLM2-135M rarely writes a parseable block; where it
            # does not, rules decide, and rules label content-free turns drop; without a
            # budget only the model's own labels apply, so the rules' wait (the context fits)
            labelled = sum(s.label is Label.DROP or s.status is Status.DROPPED for s in user_acks)
            print(f"free-form parse rate: {sum(parsed)}/{len(parsed)}; acks labelled drop {labelled}/7")
            assert len(parsed) == len(TURNS)
            assert labelled >= 5  # the last ones may be undecided yet
            assert all(s.status is Status.ACTIVE for s in user_acks if s.decided_by is DecidedBy.RULES)
        else:
            # always parseable; what the model chooses is its own (issue 4 measured it below always-keep)
            print(f"constrained: acks dropped by the model's labels {dropped}/7")
            assert all(r.stats.tagging_mode == "constrained" for r in replies)
    finally:  # a failure here must not leave blocks in the engine the next tests share
        conversation.close()
    assert smol_engine.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("text", [*WHITESPACE_MESSAGES, "Steps:\n \n- one\n\t- two"])
def test_a_message_with_any_whitespace_has_the_bare_chat_templates_ids(smol_engine, context_and_bare_template, text):
    """SmolLM2's GPT-2-style tokenizer merges whitespace (``ĊĠĠ``, ``ĠĠĠ``): each segment's
    separator must be the ids the whole message gives it, or the context differs from the
    bare model's though its text is the same."""
    tok = smol_engine.tokenizer
    conversation = Conversation(smol_engine, tagging="signals", system_prompt="Be brief.\n")
    messages = [("system", "Be brief.\n"), ("user", text), ("assistant", "Fine.  "), ("user", "And?")]
    prompt, expected = context_and_bare_template(conversation, tok, messages)
    assert prompt == tok.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("text", [*WHITESPACE_MESSAGES, "  Привет, мир.", "  日本語です。", "   😀 smile"])
def test_the_plain_modes_render_a_message_with_any_whitespace_as_the_bare_template(smol_engine, text):
    """``prefix``, ``truncate`` and ``stateless`` render whole messages (``ChatFormat.message_ids``):
    a leading run of whitespace joins the header's newline there too."""
    from clm_middleware.render.chat_format import ChatFormat

    tok = smol_engine.tokenizer
    chat = ChatFormat.from_tokenizer(tok)
    messages = [("user", text), ("assistant", "  Fine."), ("user", "\n\nAnd?")]
    prompt = chat.render([(role, chat.encode(content)) for role, content in messages])
    expected = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)
    assert prompt == list(expected if isinstance(expected, list) else expected["input_ids"])


def test_a_gguf_that_was_never_converted_gives_its_tokenizer_without_converting_the_weights(smol_engine, tmp_path):
    """Behind --engine, --model names the served model for its tokenizer only: a large
    GGUF must not be de-quantized to fp32 for that."""
    from clm_middleware.models.loading import load_tokenizer

    tokenizer = load_tokenizer(None, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing converted
    probe = "Hello, Lisbon! QX7-4821 <|im_start|>user\nçà 2,400 euros"
    assert tokenizer.encode(probe) == smol_engine.tokenizer.encode(probe)
    assert tokenizer.chat_template == smol_engine.tokenizer.chat_template
