"""A long paste with a question at its end, under a budget it outgrows: lifecycle time and the reply.

One user message of N characters (a three-sentence paragraph about the bicycle, repeated,
then "Question: according to the text above, what did early riders push along the ground
with?") sent to a fresh ``Conversation(budget=1024)`` on SmolLM2; prints the reply, the
compaction, the lifecycle phases' seconds, the end of the context and the turn's wall time.

    python docs/bench_long_question.py 12000
"""

from __future__ import annotations

import sys
import time

from clm_middleware import Conversation, Engine

PARAGRAPH = (
    "The history of the bicycle spans more than two centuries. Early designs such as the draisine had no pedals, "
    "and riders pushed along the ground with their feet. Later, pedals were attached to the front wheel. "
)
QUESTION = "Question: according to the text above, what did early riders push along the ground with?"


def main() -> None:
    characters = int(sys.argv[1]) if len(sys.argv) > 1 else 12_000
    message = (PARAGRAPH * (characters // len(PARAGRAPH) + 1))[:characters] + "\n\n" + QUESTION
    chat = Conversation(Engine.from_pretrained(), budget=1024, max_new_tokens=24)
    started = time.perf_counter()
    reply = chat.send(message)
    print("reply:", repr(reply.text))
    print("compaction:", reply.stats.compaction, "compressed tokens:", reply.stats.compressed_tokens)
    print("summaries:", len(reply.stats.summaries), "ttft_s:", round(reply.stats.ttft_s, 2))
    print("phases (s):", {k: round(v, 2) for k, v in reply.stats.phases.items()})
    print("context ends:", chat.context[-300:])
    print("wall (s):", round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    main()
