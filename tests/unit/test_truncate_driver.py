"""The truncate baseline keeps a well-formed prompt within its budget, whatever the sizes."""

import pytest

from clm_middleware.lifecycle.compaction import ContextBudgetError
from clm_middleware.render import ChatFormat
from clm_middleware.replay.runner import ReplayOptions
from clm_middleware.replay.transcript import Message
from clm_middleware.replay.truncate import TruncationDriver


def driver(engine, budget: int) -> TruncationDriver:
    return TruncationDriver(
        engine, ChatFormat.from_tokenizer(engine.tokenizer), ReplayOptions(mode="truncate"), "c", budget
    )


def test_a_newest_message_longer_than_the_budget_keeps_its_role_header_and_its_end(make_engine):
    engine = make_engine()
    truncation = driver(engine, 128)
    truncation.add(Message("user", "hello " + "word " * 300 + "the question?"))
    window = truncation.window()
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    header = list(chat.glue["user"].header_ids)
    start = len(chat.start_ids(None))
    assert len(window) <= 128
    assert window[start : start + len(header)] == header
    assert window[-len(chat.generation_prompt_ids) :] == list(chat.generation_prompt_ids)
    assert truncation.context.rstrip().endswith(chat.tokenizer.decode(chat.glue["user"].footer_ids).rstrip())
    assert "the question?" in truncation.context


def test_a_system_message_that_leaves_no_room_is_a_budget_error_not_a_prompt_over_it(make_engine):
    truncation = driver(make_engine(), 64)
    truncation.add(Message("system", "rule " * 200))
    truncation.add(Message("user", "hello"))
    with pytest.raises(ContextBudgetError, match="budget is 64"):
        truncation.window()
