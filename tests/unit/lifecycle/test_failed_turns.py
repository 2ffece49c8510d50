"""A turn that fails or is cancelled leaves no half state: no message, no held block."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clm_middleware.conversation import Conversation
from clm_middleware.errors import ConfigError, TurnCancelled
from clm_middleware.lifecycle.config import GenerationSettings, LifecycleConfig


def test_a_cancelled_turn_gives_back_its_blocks_and_discard_removes_its_message(converse, engine):
    conversation = converse(max_new_tokens=64)
    conversation.send("hello there")
    held = engine.pool.stats().blocks_in_use
    conversation.add("user", "tell me more")
    tokens = 0

    def cancelled() -> bool:
        nonlocal tokens
        tokens += 1
        return tokens > 3

    with pytest.raises(TurnCancelled):
        for _ in conversation.respond_stream(cancelled=cancelled):
            pass
    assert conversation.turn == 1 and engine.pool.stats().blocks_in_use == held
    conversation.discard(2)
    assert [m.content for m in conversation.history][:1] == ["hello there"] and len(conversation.history) == 2
    assert conversation.send("again").turn == 2


def test_discard_refuses_to_remove_an_answered_message(converse):
    conversation = converse()
    conversation.send("hello there")
    with pytest.raises(ConfigError, match="unanswered"):
        conversation.discard(0)
    assert len(conversation.history) == 2


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_an_empty_message_is_answered_as_an_empty_user_turn(converse, scripted, text):
    """As the chat template renders it and an OpenAI-compatible server answers it."""
    from clm_middleware.adapters import ChatCLM

    conversation = converse()
    reply = conversation.send(text)
    assert [m.role for m in conversation.history] == ["user", "assistant"] and reply.turn == 1
    assert conversation.history[0].segment_ids == []
    llm = ChatCLM(engine=scripted("Did you mean to write something?")[0], tagging="signals")
    assert llm.invoke(text).content == "Did you mean to write something?"


def test_a_send_over_the_budget_takes_its_message_back_so_the_next_send_works(converse):
    from clm_middleware.lifecycle.compaction import ContextBudgetError

    conversation = converse(budget=128)
    conversation.send("hello there")
    before = [(m.role, m.content) for m in conversation.history]
    with pytest.raises(ContextBudgetError):
        conversation.send("word " * 2000)
    assert [(m.role, m.content) for m in conversation.history] == before
    reply = conversation.send("short")
    assert reply.turn == 2 and [m.content for m in conversation.history][-2] == "short"


def test_a_stream_closed_before_its_end_takes_its_message_back(converse, scripted):
    engine, _ = scripted("Hi there, friend.", "A long answer that goes on and on for a while.", "Again.")
    conversation = converse(engine=engine, max_new_tokens=32)
    conversation.send("hello there")
    stream = conversation.stream("tell me more")
    assert next(stream)
    stream.close()
    assert [m.content for m in conversation.history] == ["hello there", "Hi there, friend."]
    assert conversation.send("again").turn == 2


def test_a_taken_back_message_gives_its_segment_numbers_back(converse, scripted):
    """The next message is numbered as if the taken-back one had never been sent (it had
    kept using up numbers, which a protocol model sees)."""
    engine, _ = scripted("Hi there, friend.", "A long answer that goes on and on for a while.", "Again.")
    conversation = converse(engine=engine, max_new_tokens=32)
    conversation.send("hello there")
    expected = conversation.next_segment_id()
    stream = conversation.stream("tell me more. It is a long message, in two sentences.")
    assert next(stream)
    stream.close()
    assert conversation.next_segment_id() == expected
    conversation.send("again")
    assert conversation.history[-2].segment_ids[0] == expected


def test_a_forced_reply_stream_closed_after_its_piece_is_undone_and_gives_its_blocks_back(converse):
    conversation = converse(max_new_tokens=8)
    conversation.add("user", "hello there")
    conversation.respond(forced_reply="Hi there, friend.")
    in_use = conversation.engine.pool.stats().blocks_in_use
    conversation.add("user", "tell me more")
    stream = conversation.respond_stream(forced_reply="More, then.")
    assert next(stream) == "More, then."
    stream.close()  # the caller stops reading before the turn is recorded
    assert conversation.turn == 1 and conversation.last_reply.text == "Hi there, friend."
    assert conversation.engine.pool.stats().blocks_in_use == in_use
    conversation.add("user", "again")
    assert conversation.respond(forced_reply="Again.").turn == 2


def test_a_stream_left_unfinished_is_taken_back_by_the_next_call(tiny_model, tiny_tok):
    """A ``break`` out of a stream that stays referenced: the next call closes it and takes
    its message back, so the context never shows two user messages in a row and nothing
    is discarded later, when the abandoned generator is collected."""
    import gc

    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine
    from clm_middleware.models import ScriptedReplies

    replies = ["First reply is here.", "Second reply is here.", "Third reply."]
    script = ScriptedReplies([[*tiny_tok.encode(r, add_special_tokens=False), tiny_tok.eos_token_id] for r in replies])
    engine = Engine(tiny_model, tiny_tok, logits_processors=[script])
    conversation = Conversation(engine, tagging="signals", max_new_tokens=40)
    stream = conversation.stream("Hello, stream me something.")
    for number, _ in enumerate(stream):
        if number == 2:
            break
    reply = conversation.send("A second message.")
    assert [(m.role, m.content) for m in conversation.history] == [
        ("user", "A second message."),
        ("assistant", reply.text),
    ]
    del stream
    gc.collect()  # nothing left to undo, nothing raised
    assert conversation.send("Third message.").turn == 2
    assert conversation.context.count("<|im_start|>user") == 2


def test_a_message_refused_after_compaction_tried_leaves_the_earlier_context_as_it_was(converse):
    """The refusal comes after the compaction has dropped and condensed what it could: the
    segments it changed are put back, so the model still sees the earlier turns."""
    from clm_middleware.lifecycle.compaction import ContextBudgetError

    conversation = converse(budget=256)
    for text in ("My order number is 48213-KX.", "It ships to Porto.", "Please hurry."):
        conversation.send(text)
    context, states = conversation.context, [(s.status, s.label, s.summary) for s in conversation.segments]
    fold = conversation.fold
    long = "The quick brown fox jumps over the lazy dog near the riverbank. " * 16
    with pytest.raises(ContextBudgetError, match="after removing everything removable"):
        conversation.send(long)
    assert conversation.context == context and conversation.fold == fold
    assert [(s.status, s.label, s.summary) for s in conversation.segments] == states
    conversation.send("What is my order number?")
    assert "48213-KX" in conversation.context


def test_a_turn_cancelled_after_its_compaction_undoes_it(converse, engine):
    """A caller gone while the turn generates (a client that disconnects): the turn is
    undone, and what its compaction changed goes back with it."""
    conversation = converse(budget=256, max_new_tokens=32)
    for text in ("My order number is 48213-KX.", "It ships to Porto.", "Please hurry."):
        conversation.send(text)
    context, held = conversation.context, engine.pool.stats().blocks_in_use
    states = [(s.status, s.summary) for s in conversation.segments]
    conversation.add("user", "The quick brown fox jumps over the lazy dog near the riverbank. " * 10)
    with pytest.raises(TurnCancelled):
        for _ in conversation.respond_stream(cancelled=lambda: True):
            pass
    assert conversation.turn == 3 and conversation.context.startswith(context.rsplit("<|im_end|>", 1)[0])
    assert [(s.status, s.summary) for s in conversation.segments][: len(states)] == states
    assert engine.pool.stats().blocks_in_use == held


def test_a_turn_cancelled_after_its_compaction_leaves_the_render_of_the_held_chain(converse, engine):
    """The undone turn's compacted prompt had stayed the remembered render: the segments it
    had dropped then mapped to no block of the held chain, and the next real turn held
    them for no reclamation round (a Conversation sweep)."""
    conversation = converse(budget=256, max_new_tokens=32)
    for text in ("My order number is 48213-KX.", "It ships to Porto.", "Please hurry."):
        conversation.send(text)
    before = conversation.last_render
    blocks = {s.id: conversation.blocks_of(s.id) for s in conversation.segments}
    conversation.add("user", "The quick brown fox jumps over the lazy dog near the riverbank. " * 10)
    with pytest.raises(TurnCancelled):
        for _ in conversation.respond_stream(cancelled=lambda: True):
            pass
    assert conversation.last_render is before
    assert {s.id: conversation.blocks_of(s.id) for s in conversation.segments if s.id in blocks} == blocks


@pytest.mark.parametrize("streamed", [False, True], ids=["send", "stream"])
def test_a_turn_interrupted_by_ctrl_c_takes_its_message_back(converse, engine, monkeypatch, streamed):
    conversation = converse(max_new_tokens=16)
    conversation.send("hello there")
    held, history = engine.pool.stats().blocks_in_use, [m.content for m in conversation.history]
    decode = engine.decode
    steps = 0

    def interrupted(*args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == 2:
            raise KeyboardInterrupt
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if streamed:
            list(conversation.stream("what is the capital of Peru?"))
        else:
            conversation.send("what is the capital of Peru?")
    monkeypatch.undo()
    assert [m.content for m in conversation.history] == history  # the next send does not answer it too
    assert engine.pool.stats().blocks_in_use == held
    assert conversation.send("and of Chile?").turn == 2


def test_a_turn_cancelled_while_its_long_prompt_is_computed_stops_at_the_next_chunk(converse, engine, monkeypatch):
    conversation = converse(max_new_tokens=8)
    held = engine.pool.stats().blocks_in_use
    chunks = []
    forward = engine.forward

    def counted(*args, **kwargs):
        chunks.append(len(args[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", counted)
    conversation.add("user", "a long pasted text " * 120)  # several prefill chunks
    with pytest.raises(TurnCancelled):
        for _ in conversation.respond_stream(cancelled=lambda: bool(chunks)):  # it leaves after the first chunk
            pass
    assert len(chunks) == 1  # the rest of the prompt was never computed
    assert conversation.turn == 0 and engine.pool.stats().blocks_in_use == held


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.respond(forced_reply=5), "forced_reply"),
        (lambda c: c.respond(reply_prefix=123), "reply_prefix"),
        (lambda c: c.respond(settings={"max_new_tokens": 4}), "settings"),
    ],
)
def test_an_argument_of_the_wrong_type_is_an_error_naming_it_and_the_message_stays_unanswered(converse, call, field):
    conversation = converse(max_new_tokens=4)
    conversation.add("user", "hello there")
    with pytest.raises(ConfigError, match=field):
        call(conversation)
    assert conversation.turn == 0 and conversation.respond().turn == 1


def test_a_cache_salt_that_is_not_a_string_is_refused_at_construction(converse):
    with pytest.raises(ConfigError, match="cache_salt"):
        converse(cache_salt=5)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"budget": 1024, "config": LifecycleConfig(room_turns=2)}, "budget"),
        ({"tagging": "rules", "k": 3, "config": LifecycleConfig()}, "tagging, k"),
        ({"max_new_tokens": 16, "generation": GenerationSettings(temperature=0.5)}, "max_new_tokens"),
        ({"response_format": {"type": "json_object"}, "generation": GenerationSettings()}, "response_format"),
    ],
)
def test_a_setting_given_beside_the_object_that_holds_it_is_refused_not_ignored(engine, arguments, named):
    # config= / generation= used to win silently: a budgeted chat given config=LifecycleConfig(room_turns=2)
    # ran with no budget at all
    with pytest.raises(ConfigError, match=f"{named} given beside"):
        Conversation(engine, **arguments)


def test_a_config_with_every_setting_inside_it_is_used_whole(engine):
    config = LifecycleConfig(tagging="signals", budget=256, room_turns=2, compress_min_tokens=32)
    conversation = Conversation(engine, config=config, generation=GenerationSettings(max_new_tokens=4))
    assert conversation.config.budget == 256 and conversation.config.room_turns == 2
    assert conversation.config.tagging.mode == "signals"  # a mode's name reads as Conversation(tagging=...) does
    assert conversation.config.tagging.rules.compress_min_tokens == 32
    assert conversation.generation.max_new_tokens == 4


def test_a_tagging_setting_that_is_neither_a_mode_nor_tagging_settings_is_refused():
    with pytest.raises(ConfigError, match="tagging"):
        LifecycleConfig(tagging=5)
    with pytest.raises(ConfigError, match="unknown mode"):
        LifecycleConfig(tagging="labels")


def _broken_off(conversation: Conversation, text: str) -> Iterator[str]:
    """A stream the caller leaves with ``break`` after its first piece (the caller keeps
    it referenced: the generator is not collected, nothing closes it but the next call)."""
    stream = conversation.stream(text)
    for _ in stream:
        break
    return stream


def test_closing_after_a_broken_off_stream_saves_no_trace_of_its_message(converse, engine, tmp_path):
    path = tmp_path / "chats.db"
    conversation = converse(store=path, conversation_id="c", max_new_tokens=16)
    conversation.send("My name is Zora.")
    stream = _broken_off(conversation, "Write a very long poem about dragons.")
    conversation.close()
    loaded = Conversation.load(path, "c", engine)
    assert [m.role for m in loaded.history] == ["user", "assistant"] and loaded.history[0].content == "My name is Zora."
    assert "dragons" not in loaded.context
    del stream


@pytest.mark.parametrize("decision", ["forget", "pin"])
def test_a_decision_after_a_broken_off_stream_is_not_undone_with_its_turn(converse, decision):
    conversation = converse(budget=512, max_new_tokens=16)
    conversation.send("My booking code is QX-7781.")
    target = conversation.segments[0]
    if decision == "pin":
        conversation.forget(target.id)
        conversation.send("Noted.")
    stream = _broken_off(conversation, "Tell me a long story.")
    getattr(conversation, decision)(target.id)
    assert "Tell me a long story." not in [m.content for m in conversation.history]
    conversation.send("Hello again.")
    shown = conversation.segment(target.id).visible
    assert shown == (decision == "pin") and ("QX-7781" in conversation.context) == (decision == "pin")
    del stream
