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


def test_a_prefix_turns_live_kv_is_the_chain_the_next_turn_reuses_tail_block_included(engine):
    from clm_middleware.engine.reuse import match_prefix
    from clm_middleware.replay.runner import PlainChatDriver, ReplayOptions

    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    driver = PlainChatDriver(engine, chat, ReplayOptions(mode="prefix", teacher_force=True), "c")
    for turn in range(4):
        driver.add(Message(role="user", content=f"Question {turn}: which room is the code K{turn * 7} for?"))
        record = driver.respond(Message(role="assistant", content=f"Room {turn + 3}, for K{turn * 7}."))
        hit = match_prefix(engine.pool, None, [*driver.history, *chat.generation_prompt_ids], engine.extra_key())
        assert record.live_kv_bytes == len(hit.blocks) * engine.pool.block_bytes
        hit.release(engine.pool)
