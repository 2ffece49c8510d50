"""A long evaluation session (messages + probes + where it came from), and how it is written.

Every session builder (public dialogues, τ-bench, the generators) returns a ``Session``,
so ``clm eval session`` and ``clm eval generate`` write them the same way: the transcript
as JSONL role/content lines, the probes as ``FILE.probes.json`` (the default that
``clm eval retention`` and ``clm eval answers`` look for), and optionally a sources JSON
naming the dialogues used, so that a split can be checked without rebuilding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clm_middleware.evaluation.probes import Probe, write_probes

PROBES_SUFFIX = ".probes.json"


@dataclass(frozen=True, slots=True)
class Session:
    """Messages (``{"role", "content"}``), probes whose answers occur in them, and provenance."""

    messages: list[dict[str, str]]
    probes: list[Probe]
    dialogue_ids: tuple[str, ...] = ()  # source dialogues in session order; empty when generated
    origin: dict[str, Any] = field(default_factory=dict)  # how to rebuild it: builder and arguments

    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


def default_probes_path(transcript: Path) -> Path:
    """``chat.jsonl`` → ``chat.probes.json``, next to it (``./.probes.json`` for a path
    with no name, ``.`` or ``/``: no such file, and the reader then names the directory)."""
    if not transcript.name:
        return transcript / PROBES_SUFFIX
    return transcript.with_name(transcript.stem + PROBES_SUFFIX)


def write_session(session: Session, out: Path, probes_path: Path, sources_path: Path | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(m, ensure_ascii=False) + "\n" for m in session.messages), encoding="utf-8")
    probes_path.parent.mkdir(parents=True, exist_ok=True)
    write_probes(probes_path, session.probes)
    if sources_path is not None:
        sources = {**session.origin, "dialogues": list(session.dialogue_ids)}
        sources_path.parent.mkdir(parents=True, exist_ok=True)
        sources_path.write_text(json.dumps(sources, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
