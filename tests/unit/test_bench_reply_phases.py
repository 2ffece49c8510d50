"""docs/bench_reply_phases.py: three replay reports set side by side, turn by turn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "bench_reply_phases.py"
spec = importlib.util.spec_from_file_location("bench_reply_phases", SCRIPT)
assert spec is not None and spec.loader is not None
phases_script = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = phases_script  # dataclasses look their module up there
spec.loader.exec_module(phases_script)


def report(nlls: list[float], tokens: list[int], compactions: set[int] = frozenset()) -> dict:
    turns = [{"turn": 0, "reply_nll": None, "forced_tokens": 0, "reply": "greeting"}]  # unscored: skipped
    for i, (nll, n) in enumerate(zip(nlls, tokens, strict=True), start=1):
        turn = {"turn": i, "reply_nll": nll, "forced_tokens": n, "reply": f"reply {i}"}
        turn["compaction"] = "budget" if i in compactions else None
        turns.append(turn)
    return {"turns": turns}


def test_turns_are_grouped_by_turns_since_clms_last_compaction_in_nats():
    tokens = [10, 10, 10, 10, 10, 10, 10, 10]
    clm = report([2.0, 2.0, 3.0, 2.5, 2.0, 2.0, 2.0, 2.0], tokens, compactions={3})
    truncate = report([2.0] * 8, tokens)
    keep_all = report([1.5] * 8, tokens)
    rows = phases_script.side_by_side(clm, truncate, keep_all)
    assert [r.phase for r in rows] == ["before", "before", "0", "1", "2", "3", "4+", "4+"]
    grouped = phases_script.phases(rows)
    assert grouped["before"] == (2, 20, 40.0, 40.0, 30.0)
    assert grouped["0"] == (1, 10, 30.0, 20.0, 15.0)
    assert grouped["4+"] == (2, 20, 40.0, 40.0, 30.0)


def test_reports_of_different_replies_are_refused():
    clm = report([2.0, 2.0], [10, 10])
    with pytest.raises(ValueError, match="same replies"):
        phases_script.side_by_side(clm, report([2.0, 2.0], [10, 11]), report([2.0, 2.0], [10, 10]))
    with pytest.raises(ValueError, match="same replies"):
        phases_script.side_by_side(clm, report([2.0], [10]), report([2.0, 2.0], [10, 10]))
