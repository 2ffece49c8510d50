"""Budget compaction with hysteresis: a compaction brings the prompt down to the low-water
mark, so the turns after it fit without another one."""

from __future__ import annotations

import itertools

import pytest

from clm_middleware import Conversation
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.tagging import TaggingConfig

BUDGET = 1024


def _chat(engine, low_water: float, turns: int = 60) -> list[tuple[str, int, int]]:
    """Per turn: the compaction reason, the prompt's tokens, and the context after the reply."""
    config = LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=BUDGET, low_water=low_water)
    conversation = Conversation(engine, config=config, max_new_tokens=2)
    seen = []
    for index in range(turns):
        conversation.add("user", f"Order {index} goes to gate {index % 7}, please note it down for me.")
        conversation.respond(f"Noted order {index} for gate {index % 7}.")
        stats = conversation.turn_log[-1]
        seen.append((stats.compaction, stats.prompt_tokens, conversation.context_tokens))
    return seen


def test_no_two_budget_compactions_in_a_row_when_a_turn_adds_less_than_the_slack(make_engine):
    """Each turn adds ~100 tokens (byte-level tokenizer), less than the slack a compaction
    leaves (down to at most 87.5% of the budget, where facts are kept). The messages name
    gate numbers said before, so segments the compaction removed are referred to again:
    bringing them back must not push the prompt over the budget (that was a second
    compaction in a row, of the lifecycle's own making)."""
    seen = _chat(make_engine(), low_water=0.75)
    compacted = [i for i, (reason, _, _) in enumerate(seen) if reason == "budget"]
    assert len(compacted) >= 5  # the chat outgrows the budget many times
    assert all(b - a > 1 for a, b in itertools.pairwise(compacted)), compacted
    assert all(prompt <= BUDGET for _, prompt, _ in seen)


def test_a_lower_low_water_mark_compacts_less_often(make_engine):
    often = sum(reason == "budget" for reason, _, _ in _chat(make_engine(), low_water=0.9))
    rarely = sum(reason == "budget" for reason, _, _ in _chat(make_engine(), low_water=0.5))
    assert rarely < often


def _paced_chat(engine, words: int, room_turns: int, turns: int = 40) -> list[tuple[str, int]]:
    """Per turn: the compaction reason and the context after the reply; each user message
    holds ``words`` distinct words (no fact a rule keeps), so its length sets the pace."""
    config = LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=BUDGET, room_turns=room_turns)
    conversation = Conversation(engine, config=config, max_new_tokens=2)
    seen = []
    for index in range(turns):
        text = " ".join(_word(index * words + j) for j in range(words))
        conversation.add("user", f"Then {text}.")
        conversation.respond("Right.")
        seen.append((conversation.turn_log[-1].compaction, conversation.context_tokens))
    return seen


def _word(number: int) -> str:
    """A lowercase letter word per number: no digit, nothing distinctive to keep."""
    letters = ""
    for _ in range(3):
        number, digit = divmod(number, 26)
        letters += "abcdefghijklmnopqrstuvwxyz"[digit]
    return letters


def _compactions(seen: list[tuple[str, int]]) -> list[int]:
    return [i for i, (reason, _) in enumerate(seen) if reason == "budget"]


def test_with_long_messages_a_compaction_leaves_room_for_several_turns(make_engine):
    """~150 tokens a turn: the fixed 75% mark (room_turns = 0, the default) leaves room for
    one or two turns; the pace-based mark for four, so compactions come less often and
    further apart."""
    fixed = _compactions(_paced_chat(make_engine(), words=30, room_turns=0))
    paced = _compactions(_paced_chat(make_engine(), words=30, room_turns=4))
    assert len(paced) < len(fixed), (paced, fixed)
    assert min(b - a for a, b in itertools.pairwise(paced)) >= 3, paced


def test_with_short_messages_the_mark_stays_at_low_water(make_engine):
    """A few tokens a turn: room for four turns is less than the slack of the 75% mark, so
    the conversation compacts exactly as with the fixed mark."""
    fixed = _paced_chat(make_engine(), words=1, room_turns=0, turns=90)
    paced = _paced_chat(make_engine(), words=1, room_turns=4, turns=90)
    assert _compactions(fixed), "the chat must outgrow the budget"
    assert paced == fixed


def test_the_mark_never_goes_below_min_low_water(make_engine):
    """However long the turns, a compaction stops at min_low_water of the budget (it keeps
    at least that much of the context)."""
    seen = _paced_chat(make_engine(), words=60, room_turns=50, turns=30)
    after = [context for i, (_, context) in enumerate(seen) if i in _compactions(seen)]
    assert after and all(context >= BUDGET * 0.5 - 160 for context in after), after


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("room_turns", -1),
        ("min_low_water", 0.1),
        ("min_low_water", 1.5),
        ("request_share", -0.1),
        ("request_share", 0.6),
    ],
)
def test_pace_and_share_settings_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        LifecycleConfig(budget=BUDGET, **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_reclaim_tokens", -1), ("room_turns", -1), ("protect_turns", 0), ("low_water", 0.1), ("recent_share", 1.0)],
)
def test_a_lifecycle_setting_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError) as raised:
        LifecycleConfig(**{field: value})
    assert raised.value.field == field
