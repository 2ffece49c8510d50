"""Per-turn time under a bounded context as the history grows (the tiny model: lifecycle work, not the model).

A ``Conversation(budget=512)`` on the random tiny model gets ``--turns`` short user
messages with facts, each answered by a forced reply; the mean turn time of every block
of 100 turns is printed. With the context bounded, it should stay flat.

    python docs/bench_turn_growth.py --turns 600
"""

from __future__ import annotations

import argparse
import time

from clm_middleware import Conversation
from clm_middleware.cli.setup import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=600)
    parser.add_argument("--budget", type=int, default=512)
    args = parser.parse_args()
    conversation = Conversation(build_engine("tiny"), tagging="signals", budget=args.budget, max_new_tokens=4)
    means, started = {}, time.perf_counter()
    for index in range(args.turns):
        conversation.add("user", f"Order {index} goes to gate {index % 40} at {index % 12 + 1}:15 pm, thanks a lot.")
        conversation.respond(f"Noted order {index}, gate {index % 40}.")
        if index % 100 == 99:
            now = time.perf_counter()
            means[index + 1], started = (now - started) / 100, now
    print("mean s/turn by turn:", {turn: round(seconds, 4) for turn, seconds in means.items()})
    print(f"history {len(conversation.history)} messages, context {conversation.context_tokens} tokens")


if __name__ == "__main__":
    main()
