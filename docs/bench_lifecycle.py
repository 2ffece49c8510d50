"""Issue-3 checks for the lifecycle layer, from one run, written as markdown.

    python docs/bench_lifecycle.py --out docs/bench/lifecycle.md [--max-new-tokens 32]

Replays the bundled 34-turn transcript and the 60-turn planted-fact transcript under
`clm` (tagging auto, free, constrained) with --budget 1024, generating replies, plus
truncation to the same budget, and reports per run: context tokens never over the
budget, blocks held vs. the budget plus K rounds, prefill on turns with no lifecycle
change vs. new tokens + one block, planted facts still in the final context, parse
rate, and lifecycle time by phase.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRANSCRIPTS = [
    ("lisbon_trip", ROOT / "examples/transcripts/lisbon_trip.jsonl", None),
    (
        "planted_facts_60",
        ROOT / "examples/transcripts/planted_facts_60.jsonl",
        ROOT / "examples/transcripts/planted_facts_60.probes.json",
    ),
]
TAGGINGS = ("auto", "free", "constrained")
COLUMNS = (
    "transcript",
    "run",
    "max context tokens",
    "max blocks held / budget + K rounds",
    "no-change turns within new + 1 block",
    "facts in final context",
    "prefill tokens",
    "free-form parse rate",
    "lifecycle share",
)
BUDGET, K = 1024, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    from clm_middleware.cli.setup import LifecycleOptions, build_engine, driver_factory, sibling_engine
    from clm_middleware.evaluation.probes import read_probes, retention
    from clm_middleware.lifecycle.turn import PHASES
    from clm_middleware.replay.report import ReplayReport
    from clm_middleware.replay.runner import ReplayOptions, replay
    from clm_middleware.replay.transcript import read_jsonl

    first = build_engine(None)
    block = first.block_size
    rows, phase_rows = [], []
    for name, path, probes_path in TRANSCRIPTS:
        transcripts = read_jsonl(path)
        probes = read_probes(probes_path) if probes_path else []
        for mode, tagging in [("clm", t) for t in TAGGINGS] + [("truncate", "-")]:
            engine = sibling_engine(first)
            lifecycle = LifecycleOptions(budget=BUDGET, k=K, tagging=tagging if mode == "clm" else "auto")
            options = ReplayOptions(mode=mode, max_new_tokens=args.max_new_tokens)
            report = ReplayReport(mode=mode, model=engine.model_name)
            started = time.perf_counter()
            replay(transcripts, driver_factory(engine, options, lifecycle), report, teacher_force=False)
            print(f"{name} {mode}:{tagging} {time.perf_counter() - started:.0f}s", file=sys.stderr)
            turns, totals = report.turns, report.totals()
            retained = retention(probes, lifecycle.drivers[-1].context)[0] if probes else None
            over_budget = sum(t.context_tokens > BUDGET for t in turns)
            checked = violations = 0
            for previous, turn in itertools.pairwise(turns):
                if mode == "clm" and (turn.extra["compaction"] or turn.extra["restored"]):
                    continue
                if mode == "truncate":
                    continue
                checked += 1
                new_tokens = turn.prompt_tokens - (previous.prompt_tokens + previous.generated_tokens) + 1
                violations += turn.prefill_tokens > new_tokens + block
            held = max(
                (t.extra.get("conversation_blocks", 0) + t.extra.get("reclaimer_blocks", 0) for t in turns), default=0
            )
            bound = math.ceil((BUDGET + args.max_new_tokens) / block) + max(
                (t.extra.get("reclaimer_blocks", 0) for t in turns), default=0
            )
            parse = totals.get("parse_rate")
            rows.append(
                [
                    name,
                    f"{mode}:{tagging}" if mode == "clm" else "truncate",
                    f"{totals['max_context_tokens']} ({over_budget} over)",
                    f"{held} / {bound}" if mode == "clm" else "",
                    f"{checked - violations}/{checked}" if mode == "clm" else "",
                    f"{retained}/{len(probes)}" if probes else "",
                    f"{totals['prefill_tokens']:,}",
                    "" if parse is None else f"{parse:.0%} of {totals['parse_attempts']}",
                    f"{totals.get('lifecycle_share', 0):.1%}" if mode == "clm" else "",
                ]
            )
            if mode == "clm":
                phases = totals["lifecycle_phases"]
                phase_rows.append([name, tagging, f"{totals['turn_s']:.1f}"] + [f"{phases[p]:.2f}" for p in PHASES])
    lines = [
        "Command: `python docs/bench_lifecycle.py --out docs/bench/lifecycle.md"
        + (f" --max-new-tokens {args.max_new_tokens}`" if args.max_new_tokens != 32 else "`"),
        "",
        f"Model {first.model_name}; budget {BUDGET} tokens; K = {K}; "
        f"replies generated (greedy, ≤ {args.max_new_tokens} tokens).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join(" --- " for _ in COLUMNS) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "Lifecycle time by phase (seconds):",
        "",
        "| transcript | tagging | turn time | " + " | ".join(PHASES) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " |",
        *("| " + " | ".join(row) + " |" for row in phase_rows),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
