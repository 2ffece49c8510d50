"""Per-turn time under a bounded context as the history grows (the tiny model: lifecycle work, not the model).

A ``Conversation(budget=512)`` on the random tiny model gets ``--turns`` short user
messages with facts, each answered by a forced reply; the mean turn time of every block
of 100 turns is printed. With the context bounded, it should stay flat.

``--compare-at A B``: two conversations, each on its own engine, are first brought to
turns A and B; then they take their next 100 turns alternately, one turn each, so both
see the same machine load; printed: mean lifecycle and turn time of each, and the ratio
late / early (the soak's figure: turns 1,100-1,200 against 100-200).

    python docs/bench_turn_growth.py --turns 600
    python docs/bench_turn_growth.py --compare-at 100 1100
"""

from __future__ import annotations

import argparse
import statistics
import time

from clm_middleware import Conversation
from clm_middleware.cli.setup import build_engine
from clm_middleware.lifecycle.turn import TurnStats


def _conversation(budget: int) -> Conversation:
    return Conversation(build_engine("tiny"), tagging="signals", budget=budget, max_new_tokens=4)


def _turn(conversation: Conversation, index: int) -> TurnStats:
    conversation.add("user", f"Order {index} goes to gate {index % 40} at {index % 12 + 1}:15 pm, thanks a lot.")
    return conversation.respond(f"Noted order {index}, gate {index % 40}.").stats


def _growth(turns: int, budget: int) -> None:
    conversation = _conversation(budget)
    means, started = {}, time.perf_counter()
    for index in range(turns):
        _turn(conversation, index)
        if index % 100 == 99:
            now = time.perf_counter()
            means[index + 1], started = (now - started) / 100, now
    print("mean s/turn by turn:", {turn: round(seconds, 4) for turn, seconds in means.items()})
    print(f"history {len(conversation.history)} messages, context {conversation.context_tokens} tokens")


def _compare(early_at: int, late_at: int, budget: int, span: int = 100) -> None:
    early, late = _conversation(budget), _conversation(budget)
    for index in range(late_at):
        if index < early_at:
            _turn(early, index)
        _turn(late, index)
    seen: dict[str, list[TurnStats]] = {"early": [], "late": []}
    for step in range(span):
        seen["early"].append(_turn(early, early_at + step))
        seen["late"].append(_turn(late, late_at + step))
    rows = {}
    for name, at in (("early", early_at), ("late", late_at)):
        stats = seen[name]
        lifecycle, turn = statistics.mean(s.lifecycle_s for s in stats), statistics.mean(s.turn_s for s in stats)
        rows[name] = (lifecycle, turn)
        context = statistics.mean(s.context_tokens for s in stats)
        print(
            f"turns {at}-{at + span}: lifecycle {lifecycle * 1000:.1f} ms/turn, turn {turn * 1000:.1f} ms/turn, "
            f"context {context:.0f} tokens"
        )
    (early_life, early_turn), (late_life, late_turn) = rows["early"], rows["late"]
    print(f"late / early: lifecycle {late_life / early_life:.2f}x, turn {late_turn / early_turn:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=600)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--compare-at", type=int, nargs=2, metavar=("EARLY", "LATE"))
    args = parser.parse_args()
    if args.compare_at:
        _compare(*args.compare_at, budget=args.budget)
    else:
        _growth(args.turns, args.budget)


if __name__ == "__main__":
    main()
