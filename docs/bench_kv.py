"""Engine-level KV measurements for issue 16, each system alternating turn by turn in one run.

    python docs/bench_kv.py reuse [TRANSCRIPT]     # block-granular vs token-exact reuse
    python docs/bench_kv.py decode                 # decode tokens/s per attention path
    python docs/bench_kv.py kv-dtype [TRANSCRIPT]  # pool storage dtype: peak KV and reply_nll

Every variant is its own engine (own pool) over the same SmolLM2 weights; ratios
from one run are comparable on a noisy machine, single times are not.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from clm_middleware.cli.setup import build_engine
from clm_middleware.engine import Engine
from clm_middleware.render import ChatFormat
from clm_middleware.replay.formats import read_transcripts
from clm_middleware.replay.plain import PlainChatDriver
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import ReplayOptions, replay_interleaved

BUNDLED = Path(__file__).parent.parent / "examples" / "transcripts" / "lisbon_trip.jsonl"


def teacher_forced(engines: dict[str, Engine], transcript: Path) -> dict[str, ReplayReport]:
    """A ``prefix`` replay of ``transcript`` per engine, teacher-forced, turn by turn in rotating order."""
    options = ReplayOptions(mode="prefix", teacher_force=True)
    transcripts = read_transcripts(transcript)
    factories = {
        name: (
            lambda t, e=engine: PlainChatDriver(e, ChatFormat.from_tokenizer(e.tokenizer), options, t.conversation_id)
        )
        for name, engine in engines.items()
    }
    reports = {name: ReplayReport(mode=name, model="smollm2") for name in engines}
    return replay_interleaved(transcripts, factories, reports, teacher_force=True)


def exactly_new_tokens(report: ReplayReport) -> int:
    """The least any reuse can prefill: each turn's tokens after what the previous turn
    computed (its prompt and forced reply, less the reply's last token, never fed)."""
    total, computed = 0, 0
    for turn in report.turns:
        total += turn.prompt_tokens - computed
        computed = turn.prompt_tokens + turn.forced_tokens - 1
    return total


def reuse(args: argparse.Namespace) -> None:
    token_exact = build_engine()
    block_granular = Engine(token_exact.model, token_exact.tokenizer)
    block_granular.pool.match_tail = lambda *_args: None  # reuse full blocks only, as before issue 16
    reports = teacher_forced({"block-granular": block_granular, "token-exact": token_exact}, args.transcript)
    rows = [
        ("prefill tokens", lambda r: f"{r.totals()['prefill_tokens']:,}"),
        ("exactly the new tokens", lambda r: f"{exactly_new_tokens(r):,}"),
        ("hit rate", lambda r: f"{r.totals()['hit_rate']:.1%}"),
        ("TTFT sum (s)", lambda r: f"{r.totals()['ttft_s']:.2f}"),
        ("TTFT p95 (s)", lambda r: f"{r.totals()['ttft_p95_s']:.3f}"),
        ("reply_nll", lambda r: f"{r.totals()['reply_nll']:.4f}"),
    ]
    print_table(reports, rows, f"{args.transcript.name}, {len(reports['token-exact'].turns)} turns, teacher-forced")


def print_table(reports: dict[str, ReplayReport], rows, caption: str) -> None:
    print(caption)
    print("| metric | " + " | ".join(reports) + " |")
    print("| --- |" + " --- |" * len(reports))
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(report) for report in reports.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("reuse", help="block-granular vs token-exact prefix reuse")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.set_defaults(run=reuse)
    args = parser.parse_args()
    started = time.perf_counter()
    args.run(args)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
