"""Bounded memory under load: 4 conversations × 500 turns on one pool (tiny model).

    python docs/soak.py --out docs/bench/soak.md

Targets (issue 7): RSS within 10% of its post-warm-up value, zero blocks held after
every conversation is closed, zero messages missing from the store.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=500)
    args = parser.parse_args()

    from clm_middleware.evaluation.soak import soak

    with tempfile.TemporaryDirectory() as folder:
        result = soak(conversations=args.conversations, turns=args.turns, store_path=Path(folder) / "soak.db")
    lines = [
        "Command: `python docs/soak.py --out docs/bench/soak.md`",
        "",
        f"{result.conversations} conversations × {result.turns} turns in threads on one pool "
        f"(tiny model, 256 blocks, budget 512 tokens), {result.seconds:.0f} s.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| RSS after {result.warmup_turns} warm-up turns | {result.rss_after_warmup_mb:.1f} MiB |",
        f"| RSS at the end | {result.rss_end_mb:.1f} MiB ({result.rss_growth:+.1%}) |",
        f"| blocks held after every conversation closed | {result.blocks_held_at_end} |",
        f"| messages sent / stored | {result.messages_sent} / {result.messages_stored} |",
        f"| pool evictions | {result.evictions:,} |",
        f"| max context tokens | {result.max_context_tokens} |",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
