"""``clm`` with and without ``--compact-ahead`` on the same sessions, alternating which runs first.

Teacher-forced, budget 1024, default settings otherwise: the bundled chat, the SGD and
MultiWOZ tuning sessions and the 200-turn long-message session, then the bundled chat in
``prefix`` mode for its TTFT p95. Each replay is ``clm replay FILE --mode clm --budget 1024
--teacher-force --probes P [--compact-ahead] --report R.json``; the table takes the
report totals (which count a compacted context computed ahead in the prompt, cached and
prefill tokens). Writes ``OUT/summary.md`` and ``OUT/totals.json``; the full reports go
to ``OUT/reports/`` (not committed: ~2 MB).

    python docs/bench_compact_ahead.py --out docs/bench/compact_ahead
    python docs/bench_compact_ahead.py --variants default ahead_approx \
        --sessions lisbon_trip chitchat_200 --out docs/bench/compact_ahead_approx

``--variants`` picks the settings (``ahead_approx``: ``--compact-ahead --approximate-reuse
0.15``), ``--sessions`` the sessions by file name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLM = str(Path(sys.executable).parent / "clm")
SESSIONS = {
    "bundled chat (34 turns)": "examples/transcripts/lisbon_trip.jsonl",
    "SGD session (130 turns)": "examples/retention/sgd_session_10.jsonl",
    "MultiWOZ session (92 turns)": "examples/retention/multiwoz_session_10.jsonl",
    "200-turn long-message session": "examples/retention/heldout/long/chitchat_200.jsonl",
}
VARIANTS = {
    "at the turn (default)": [],
    "ahead": ["--compact-ahead"],
    "ahead + approximate reuse": ["--compact-ahead", "--approximate-reuse", "0.15"],
}
SLUGS = {"at the turn (default)": "default", "ahead": "ahead", "ahead + approximate reuse": "ahead_approx"}


def replay(path: str, flags: list[str], report: Path) -> dict:
    probes = path.removesuffix(".jsonl") + ".probes.json"
    command = [CLM, "replay", path, "--teacher-force", "--quiet", "--report", str(report)]
    if flags == ["prefix"]:
        command += ["--mode", "prefix"]
    else:
        command += ["--mode", "clm", "--budget", "1024", "--probes", probes, *flags]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/bench/compact_ahead")
    parser.add_argument(
        "--variants", nargs="+", choices=list(SLUGS.values()), default=["default", "ahead"], help="which settings"
    )
    parser.add_argument(
        "--sessions", nargs="+", choices=[Path(p).stem for p in SESSIONS.values()], help="which sessions [all]"
    )
    args = parser.parse_args()
    reports = args.out / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    variants = [(name, flags) for name, flags in VARIANTS.items() if SLUGS[name] in args.variants]
    sessions = [(name, p) for name, p in SESSIONS.items() if not args.sessions or Path(p).stem in args.sessions]
    totals: dict[str, dict] = {}
    for number, (name, path) in enumerate(sessions):
        order = variants if number % 2 == 0 else list(reversed(variants))
        for variant, flags in order:
            report = replay(path, flags, reports / f"{Path(path).stem}_{SLUGS[variant]}.json")
            totals[f"{name} | {variant}"] = report["totals"] | {"retention": report.get("retention")}
    prefix = replay(SESSIONS["bundled chat (34 turns)"], ["prefix"], reports / "lisbon_trip_prefix.json")
    totals["bundled chat (34 turns) | prefix"] = prefix["totals"]
    (args.out / "totals.json").write_text(json.dumps(totals, indent=1, default=str))
    lines = [
        "| session | compaction | compactions | prefill tokens | hit rate | TTFT p50 / p95 (s) | turn time (s) "
        "| reply_nll | facts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, t in totals.items():
        name, variant = key.split(" | ")
        retention = t.get("retention") or {}
        facts = f"{retention['retained']}/{retention['probes']}" if retention else ""
        compactions = sum(t.get("compactions", {}).values()) if variant != "prefix" else ""
        lines.append(
            f"| {name} | {variant} | {compactions} | {t['prefill_tokens']:,} | {t['hit_rate']:.1%} "
            f"| {t['ttft_p50_s']:.3f} / {t['ttft_p95_s']:.3f} | {t['turn_s']:.1f} | {t['reply_nll']:.4f} | {facts} |"
        )
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
