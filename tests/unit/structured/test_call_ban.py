"""A reply that may make no tool call cannot open one (structured/call_ban.py): no line
starts with '<', '<tool' is written nowhere, and the ban yields rather than leave nothing."""

from __future__ import annotations

import re

import torch

from clm_middleware.adapters.chat_call import answers_a_result
from clm_middleware.adapters.messages import Turn, turn_digest
from clm_middleware.conversation import Conversation
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.structured.call_ban import CallOpeningBan, call_ban_for

TEXTS = [b"<", b"tool", b"_call>", b"Hello", b" <", b"\n", b"  ", b"a<tool", b"\n<", b"x", b"<t", b"<|im_end|>"]
ID = {text: i for i, text in enumerate(TEXTS)}
BAN = CallOpeningBan(TEXTS, len(TEXTS), exempt=frozenset({ID[b"<|im_end|>"]}))


def banned_after(*texts: bytes) -> set[bytes]:
    logits = torch.zeros(len(TEXTS))
    shaped = BAN([ID[t] for t in texts], logits)
    return {TEXTS[i] for i in range(len(TEXTS)) if shaped[i] == float("-inf")}


def test_at_the_reply_start_no_token_opens_a_line_with_a_tag_but_the_stop_token_may_end_it():
    assert banned_after() == {b"<", b" <", b"\n<", b"a<tool", b"<t"}
    assert b"<|im_end|>" not in banned_after(b"Hello", b"\n")


def test_a_server_is_sent_the_line_start_ban_for_the_whole_reply():
    assert {TEXTS[i] for i, bias in BAN.everywhere if bias == -100} == {b"<", b" <", b"\n<", b"a<tool", b"<t"}


def test_within_a_line_a_tag_may_open_but_a_later_line_may_not_start_with_one():
    assert banned_after(b"Hello") == {b"\n<", b"a<tool"}


def test_the_opener_head_is_banned_where_the_text_so_far_begins_it():
    assert b"tool" in banned_after(b"Hello", b" <")
    assert b"x" not in banned_after(b"Hello", b" <")


def test_blanks_after_a_newline_keep_the_line_start():
    assert b"<" in banned_after(b"Hello", b"\n", b"  ")
    assert b"<" not in banned_after(b"Hello", b"\n", b"  ", b"x")


def test_the_ban_yields_where_it_would_leave_nothing_and_never_writes_its_input():
    logits = torch.full((len(TEXTS),), float("-inf"))
    logits[ID[b"<"]] = 0.0  # a scripted reply forcing '<' at the start
    assert torch.equal(BAN([], logits), logits)
    free = torch.zeros(len(TEXTS))
    BAN([], free)
    assert torch.equal(free, torch.zeros(len(TEXTS)))


def test_a_reply_pushed_toward_a_call_opening_writes_none(engine):
    """The tiny model with '<' and 't' pushed to the top: without the ban the reply is
    '<<<...'; with it, no line starts with '<' and '<tool' never appears."""
    lt, t = engine.tokenizer.convert_tokens_to_ids(["<", "t"])
    push = GenerationSettings(max_new_tokens=24, logit_bias=((lt, 100.0), (t, 50.0)), cut_repeats=False)
    banned = GenerationSettings(**{**_fields(push), "forbid_tool_calls": True})
    replies = []
    for settings in (push, banned):
        conversation = Conversation(engine, tagging="rules")
        conversation.add("user", "What is the weather in Oslo?")
        replies.append(conversation.respond(settings=settings).text)
        conversation.close()
    free, reply = replies
    assert free.startswith("<"), free
    assert reply and "<tool" not in reply and not re.search(r"(^|\n)[ \t]*<", reply), reply
    assert call_ban_for(engine) is call_ban_for(engine)  # built once per engine


def _fields(settings: GenerationSettings) -> dict:
    return {name: getattr(settings, name) for name in GenerationSettings.__dataclass_fields__}


def test_only_a_reply_to_a_tools_result_is_kept_from_opening_a_call():
    """The copy happens right after the result; a later reply may write markup (an HTML
    page asked for had looped on code fences under the ban)."""

    def turns(*pairs: tuple[str, str]) -> list[Turn]:
        return [Turn(role, text, turn_digest(role, text)) for role, text in pairs]

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    history = [("user", "Weather in Paris?"), ("assistant", call), ("tool", "Rain, 12C.")]
    assert answers_a_result(turns(*history))
    later = [*history, ("assistant", "It rains."), ("user", "Write a minimal HTML page titled Hello.")]
    assert not answers_a_result(turns(*later))
    assert not answers_a_result(turns(("user", f"What does {call} mean?"), ("tool", "a result")))
