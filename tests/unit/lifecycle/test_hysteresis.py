"""Budget compaction with hysteresis: a compaction brings the prompt down to the low-water
mark, so the turns after it fit without another one."""

from __future__ import annotations

import itertools

from clm_middleware import Conversation
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
