"""Oversized input has a bounded cost: one long message at budget 1024, next to a 1,024-token prefill.

For each size, a fresh ``Conversation(budget=1024)`` on SmolLM2 gets one user message of
that many tokens (prose from the bundled transcript, repeated); the turn's wall time is
compared with prefilling 1,024 tokens from scratch (the cost of one full-budget turn).
A message over ``budget × target_ratio`` tokens is refused before any model work; one
under it is condensed to fit, or refused after condensing if even that cannot fit.

    python docs/bench_oversized.py --out docs/bench/oversized.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from clm_middleware import Conversation, Engine
from clm_middleware.errors import ClmError

TRANSCRIPT = Path(__file__).parents[1] / "examples" / "transcripts" / "lisbon_trip.jsonl"
SIZES = (2_000, 4_000, 10_000)


def prose(engine: Engine, tokens: int) -> str:
    lines = [json.loads(line)["content"] for line in TRANSCRIPT.read_text().splitlines() if line.strip()]
    text, words = "", " ".join(lines).split()
    while len(engine.tokenizer.encode(text)) < tokens:
        text += " " + " ".join(words)
    ids = engine.tokenizer.encode(text)[:tokens]
    return engine.tokenizer.decode(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/oversized.md"))
    args = parser.parse_args()
    engine = Engine.from_pretrained()
    filler = engine.tokenizer.encode(prose(engine, args.budget))[: args.budget]
    started = time.perf_counter()
    engine.generate(filler, max_new_tokens=1, use_pool=False).result()
    prefill_s = time.perf_counter() - started
    rows = []
    for size in SIZES:
        text = prose(engine, size)
        with Conversation(engine, budget=args.budget, max_new_tokens=16) as chat:
            started = time.perf_counter()
            try:
                reply = chat.send(text)
                outcome = f"answered; context {reply.stats.context_tokens} tokens"
            except ClmError as error:
                outcome = f"refused: {error.message}"
            seconds = time.perf_counter() - started
        rows.append((size, seconds, outcome))
        print(size, f"{seconds:.2f}s", outcome, flush=True)
    lines = [
        f"`python docs/bench_oversized.py --budget {args.budget}`",
        "",
        f"Prefilling {args.budget} tokens from scratch: {prefill_s:.2f} s.",
        "",
        "| message tokens | turn time (s) | ÷ prefill of the budget | outcome |",
        "| --- | --- | --- | --- |",
        *(f"| {size:,} | {seconds:.2f} | {seconds / prefill_s:.2f}× | {outcome} |" for size, seconds, outcome in rows),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
