"""``--json`` output of ``clm replay`` and ``clm chat``: one JSON object per line on stdout.

Every line has a ``type``: ``turn`` (an answered turn: the fields of its report record,
see docs/report.md, with ``role: "assistant"`` and the ``reply`` text), ``failed_turn``
(``--on-error skip`` went past it, or ``stop`` stopped at it: ``turn``,
``conversation_id``, ``error``),
``skipped_record`` (a transcript record that could not be read: ``error`` names where),
``error`` (``clm chat``: a message was refused; the chat goes on) and, last, ``totals``
(``clm replay``: the report's totals and ``complete``; also written when the replay stops
at a failed turn, whose ``failed_turn`` line comes first, or is interrupted). Lines are
written and flushed as they happen, so a script can follow a long run; nothing else is
written to stdout in this mode (progress and warnings go to stderr). JSON is
ASCII-escaped, so any terminal encoding can carry it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from clm_middleware.replay.report import Failure, ReplayReport, TurnRecord


def emit(data: dict[str, Any]) -> None:
    """Write one line and flush it (a pipe would otherwise hold it back)."""
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def turn_line(record: TurnRecord) -> dict[str, Any]:
    return {"type": "turn", "role": "assistant", **record.as_dict()}


def failure_line(failure: Failure) -> dict[str, Any]:
    kind = "failed_turn" if failure.turn is not None else "skipped_record"
    return {"type": kind, **failure.as_dict()}


def totals_line(report: ReplayReport) -> dict[str, Any]:
    return {
        "type": "totals",
        "mode": report.mode,
        "model": report.model,
        "complete": report.complete,
        **report.totals(),
    }


def chat_turn_line(conversation_id: str, reply: Any) -> dict[str, Any]:
    """A ``clm chat`` turn: the reply, its stats (``TurnStats``), and the labels decided this turn."""
    return {
        "type": "turn",
        "conversation_id": conversation_id,
        "role": "assistant",
        "reply": reply.text,
        "finish_reason": reply.finish_reason,
        **reply.stats.as_dict(),
        "labels": [decision.as_dict() for decision in reply.decisions],
    }


def error_line(message: str) -> dict[str, Any]:
    return {"type": "error", "error": message}
