"""SmolLM2-135M through the middleware answers in words, like the bare model: no marker, no block, no id."""

import functools
import json
from pathlib import Path

from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.lifecycle.reply_quality import has_artifact
from clm_middleware.models import ScriptedReplies
from clm_middleware.render.chat_format import ChatFormat
from clm_middleware.replay.plain import SystemHead

SYSTEM = "You are a helpful airline customer support agent."
QUICKSTART = [
    "Hi!",
    "My booking reference is ZK4R2P. I need to move my flight to Friday.",
    "It is the morning flight from Lisbon to Paris.",
    "ok thanks",
]
DEMO = Path(__file__).parents[2] / "examples" / "transcripts" / "lisbon_trip.jsonl"


def test_the_readme_quickstart_replies_in_words_without_protocol_artifacts(smol_engine):
    with Conversation(smol_engine, system_prompt=SYSTEM, budget=1024, max_new_tokens=40) as chat:
        assert chat.calibration is not None and chat.calibration.follows is False  # SmolLM2 cannot follow it
        for message in QUICKSTART:
            reply = chat.send(message)
            assert reply.text.strip() and not has_artifact(reply.text), reply.text
            assert "protocol_artifact" not in reply.stats.reply_flags
            assert not reply.stats.protocol_context and reply.stats.tagging_mode == "signals"
        assert "[seg_" not in chat.context and "LIFECYCLE" not in chat.context
    assert smol_engine.pool.stats().blocks_in_use == 0  # the engine is shared with later tests


def test_a_ten_turn_generated_replay_carries_no_protocol_artifact(tmp_path):
    kept, answered = [], 0
    for line in DEMO.read_text(encoding="utf-8").splitlines():
        kept.append(line)
        answered += json.loads(line)["role"] == "assistant"
        if answered == 10:
            break
    path = tmp_path / "lisbon10.jsonl"
    path.write_text("\n".join(kept) + "\n")
    report_path = tmp_path / "report.json"
    arguments = ["replay", str(path), "--mode", "clm", "--budget", "1024", "--max-new-tokens", "24", "--quiet"]
    result = CliRunner().invoke(cli, [*arguments, "--report", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert len(report["turns"]) == 10
    assert report["totals"]["reply_flags"].get("protocol_artifact", 0) == 0
    assert not any(has_artifact(turn["reply"]) for turn in report["turns"])


def test_a_context_that_fits_has_the_ids_of_the_bare_chat_template(smol_engine):
    """Segments joined by a space, a blank line or a list break tokenize as the whole
    message does (``ĠI``, not ``Ġ`` ``I``; two ``Ċ``, not ``ĊĊ``)."""
    messages = [{"role": "system", "content": SYSTEM}]
    for line in DEMO.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        messages.append({"role": record["role"], "content": record["content"]})
    messages.append({"role": "user", "content": "Thanks.\n\nOne more thing. Is 7pm OK?\n1. first\n2. second"})
    chat = Conversation(smol_engine, tagging="signals", budget=smol_engine.max_positions - 256)  # labels wait: it fits
    for message in messages:
        chat.add(message["role"], message["content"])
    bare = smol_engine.tokenizer.apply_chat_template(messages, tokenize=True)
    bare_ids = list(bare["input_ids"]) if hasattr(bare, "keys") else list(bare)
    assert sum(len(m.segment_ids) for m in chat.history) > len(messages)  # sentences are segments
    assert chat.context_ids == bare_ids
    chat.close()


TOOLS_SECTION = "You may call this tool:\n<tools>\n{}\n</tools>"


def _template_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def test_a_tools_section_joins_the_system_message_as_the_template_tokenizes_their_one_text(smol_engine):
    """The blank line between a tools section (or a JSON instruction) and the system
    message's own text reads ``Ċ`` ``Ċ`` inside the one string the template tokenizes, not
    the ``ĊĊ`` it reads alone: both managed and plain prompts hold the template's ids."""
    tokenizer = smol_engine.tokenizer
    # a word, a word that carries its own space, a newline the blank line merges with (ĊĊ Ċ)
    for system in (SYSTEM, " You are terse.", "\nYou are terse.\n"):
        messages = [{"role": "system", "content": TOOLS_SECTION + "\n\n" + system}, {"role": "user", "content": "Hi"}]
        chat = Conversation(
            smol_engine, system_prompt=system, tagging="signals", budget=smol_engine.max_positions - 256
        )
        chat.set_tools_prompt(TOOLS_SECTION)
        chat.add("user", "Hi")
        assert chat.context_ids == _template_ids(tokenizer, messages)
        chat.close()
        chat_format = ChatFormat.from_tokenizer(tokenizer)
        head = SystemHead(chat_format, TOOLS_SECTION).system_message(chat_format.encode(system))
        assert head == _template_ids(tokenizer, messages[:1])


def test_chatclm_counts_a_history_with_tools_as_many_tokens_as_its_reply_was_shown(smol_engine):
    from langchain_core.messages import HumanMessage, SystemMessage

    from clm_middleware.adapters import ChatCLM

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatCLM(engine=smol_engine, max_tokens=4, tagging="signals")
    for system in ("You are a helpful assistant.", "\nYou are a helpful assistant.\n"):
        history = [SystemMessage(system), HumanMessage("Weather in Lima?")]
        reply = llm.bind_tools([get_weather]).invoke(history)
        assert reply.usage_metadata["input_tokens"] == llm.get_num_tokens_from_messages(history, tools=[get_weather])
        llm.conversation(reply.response_metadata["conversation_id"]).close()  # the engine is shared with later tests
    assert smol_engine.pool.stats().blocks_in_use == 0


def test_a_reply_generated_in_tokens_the_tokenizer_would_not_use_is_kept_as_its_text_tokenizes(smol_engine):
    """SmolLM2 may write " pasta" as " past" + "a": the next prompt holds the reply as the
    bare chat template tokenizes it (what a client re-sending the history has), not as
    generated; before, such a chat through ``clm serve`` diverged from the bare model."""
    tokenizer = smol_engine.tokenizer
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    spelled = encode("Try the") + encode(" past") + encode("a") + encode(".")
    assert tokenizer.decode(spelled) == "Try the pasta." and encode("Try the pasta.") != spelled
    script = ScriptedReplies([[*spelled, tokenizer.eos_token_id]])
    engine = Engine(smol_engine.model, tokenizer, logits_processors=[script])
    with Conversation(engine, system_prompt=SYSTEM, tagging="signals", max_new_tokens=16) as chat:
        reply = chat.send("What should I eat in Rome?")
        assert reply.text == "Try the pasta."
        chat.add("user", "Thanks.")
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What should I eat in Rome?"},
            {"role": "assistant", "content": "Try the pasta."},
            {"role": "user", "content": "Thanks."},
        ]
        bare = tokenizer.apply_chat_template(messages, tokenize=True)
        assert chat.context_ids == (list(bare["input_ids"]) if hasattr(bare, "keys") else list(bare))
