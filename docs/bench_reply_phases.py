"""Where clm's replies read worse: reply_nll per turn under clm, truncation and keep-all.

Reads three ``clm replay FILE --mode M --budget N --teacher-force --report R.json``
reports of one session (clm, truncate, prefix) and sets their per-turn ``reply_nll``
side by side, in nats (``reply_nll`` × forced tokens), so no model runs here. Prints the
three token-weighted means, the midpoint between truncation and keep-all (issue 12's
target) and how many nats clm is from it; then the turns grouped by turns since clm's
last compaction (``before`` the first one, ``0`` the compaction turn itself, ``4+``);
then the turns where clm loses most against truncation and those where keep-all gains
most over it, with each turn's reply.

    python docs/bench_reply_phases.py --clm C.json --truncate T.json --keep-all P.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAST_PHASE = 4  # turns this many or more after a compaction are one group


@dataclass(frozen=True, slots=True)
class TurnNats:
    """One forced reply: its tokens and its summed negative log-likelihood per mode."""

    turn: int
    tokens: int
    phase: str  # turns since clm's last compaction: "before", "0" … "4+"
    clm: float
    truncate: float
    keep_all: float
    reply: str


def scored_turns(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's turns that scored a forced reply, in order."""
    return [t for t in report["turns"] if t.get("reply_nll") is not None and t.get("forced_tokens")]


def phase_name(since: int | None) -> str:
    if since is None:
        return "before"
    return f"{LAST_PHASE}+" if since >= LAST_PHASE else str(since)


def side_by_side(clm: dict[str, Any], truncate: dict[str, Any], keep_all: dict[str, Any]) -> list[TurnNats]:
    """The three reports' scored turns, matched in order; they must be replays of one
    transcript (the same forced replies, token for token), else ``ValueError``."""
    scored = [scored_turns(report) for report in (clm, truncate, keep_all)]
    rows = list(zip(*scored, strict=False))
    if len({len(turns) for turns in scored}) != 1 or any(
        len({a["forced_tokens"], b["forced_tokens"], c["forced_tokens"]}) > 1 for a, b, c in rows
    ):
        raise ValueError("the reports do not score the same replies: replay one transcript teacher-forced in each mode")
    since: int | None = None
    out = []
    for c, t, k in rows:
        since = 0 if c.get("compaction") else (None if since is None else since + 1)
        n = c["forced_tokens"]
        out.append(
            TurnNats(
                c["turn"], n, phase_name(since), c["reply_nll"] * n, t["reply_nll"] * n, k["reply_nll"] * n, c["reply"]
            )
        )
    return out


def phases(rows: Sequence[TurnNats]) -> dict[str, tuple[int, int, float, float, float]]:
    """Per phase: turns, tokens and the summed nats of clm, truncation and keep-all."""
    order = ["before", *(str(i) for i in range(LAST_PHASE)), f"{LAST_PHASE}+"]
    grouped: dict[str, tuple[int, int, float, float, float]] = {}
    for name in order:
        members = [r for r in rows if r.phase == name]
        if members:
            grouped[name] = (
                len(members),
                sum(r.tokens for r in members),
                sum(r.clm for r in members),
                sum(r.truncate for r in members),
                sum(r.keep_all for r in members),
            )
    return grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clm", required=True, help="clm replay report (--mode clm)")
    parser.add_argument("--truncate", required=True, help="clm replay report (--mode truncate)")
    parser.add_argument("--keep-all", required=True, help="clm replay report (--mode prefix)")
    parser.add_argument("--top", type=int, default=8, help="turns to list in each ranking")
    args = parser.parse_args()
    reports = [json.loads(Path(path).read_text(encoding="utf-8")) for path in (args.clm, args.truncate, args.keep_all)]
    rows = side_by_side(*reports)
    tokens = sum(r.tokens for r in rows)
    clm, truncate, keep_all = (sum(getattr(r, m) for r in rows) for m in ("clm", "truncate", "keep_all"))
    midpoint = (truncate + keep_all) / 2
    print(
        f"reply_nll clm {clm / tokens:.4f}, truncate {truncate / tokens:.4f}, keep-all {keep_all / tokens:.4f}; "
        f"midpoint {midpoint / tokens:.4f}: clm is {clm - midpoint:+.1f} nats from it over {tokens} tokens"
    )
    print("\n| turns since clm's last compaction | turns | clm | truncate | keep-all | clm − truncate (nats) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (count, n, c, t, k) in phases(rows).items():
        print(f"| {name} | {count} | {c / n:.3f} | {t / n:.3f} | {k / n:.3f} | {c - t:+.1f} |")
    print("\nclm's largest losses against truncation (nats: clm − truncate, keep-all − truncate):")
    for r in sorted(rows, key=lambda r: r.truncate - r.clm)[: args.top]:
        print(
            f"  turn {r.turn} ({r.phase}): {r.clm - r.truncate:+.1f}, {r.keep_all - r.truncate:+.1f}  {r.reply[:90]!r}"
        )
    print("keep-all's largest gains over truncation (nats: keep-all − truncate, clm − truncate):")
    for r in sorted(rows, key=lambda r: r.keep_all - r.truncate)[: args.top]:
        print(
            f"  turn {r.turn} ({r.phase}): {r.keep_all - r.truncate:+.1f}, {r.clm - r.truncate:+.1f}  {r.reply[:90]!r}"
        )


if __name__ == "__main__":
    main()
