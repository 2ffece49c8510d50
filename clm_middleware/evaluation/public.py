"""Long sessions with probes from public task-oriented dialogues (SGD, MultiWOZ).

Several dialogues are concatenated into one conversation, so that it outgrows a
context budget. Probes come from each dataset's own ground truth: SGD's final user
state (the slot values the user asked for), MultiWOZ's user goal (constraints and
booking details). A value becomes a probe only if it occurs in the session's text as
a whole word (otherwise even keeping everything could not retain it) and is at least
three characters long and not a yes/no flag (a single digit or "true" would match
by accident).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clm_middleware.errors import TranscriptError
from clm_middleware.evaluation.probes import Probe
from clm_middleware.replay.transcript import read_jsonl

DATASETS = ("sgd", "multiwoz")
_FLAGS = {"true", "false", "yes", "no", "none", "dontcare", "not mentioned"}


def build_session(
    dataset: str,
    index_path: str | Path,
    transcripts_path: str | Path,
    *,
    dialogues: int = 10,
    seed: int = 0,
    system: str | None = "You are a helpful booking assistant.",
) -> tuple[list[dict[str, str]], list[Probe]]:
    """One long session of ``dialogues`` dialogues drawn with ``seed``, and its probes."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}")
    index = _load_index(Path(index_path))
    by_id = {t.conversation_id: t for t in read_jsonl(transcripts_path)}
    entries = [entry for entry in index["conversations"] if entry["conversation_id"] in by_id]
    if not entries:
        raise TranscriptError(str(transcripts_path), None, "no dialogue of the index is in this transcript file")
    chosen = random.Random(seed).sample(entries, min(dialogues, len(entries)))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    candidates: list[Probe] = []
    for entry in chosen:
        transcript = by_id[entry["conversation_id"]]
        messages += [
            {"role": m.role, "content": m.content} for m in transcript.messages if m.role in ("user", "assistant")
        ]
        values = _sgd_values(entry) if dataset == "sgd" else _multiwoz_values(entry)
        candidates += [Probe(question, answers[0], tuple(answers[1:])) for question, answers in values]
    text = "\n".join(m["content"] for m in messages)
    probes = _dedupe(p for p in candidates if _usable(p) and p.retained_in(text))
    return messages, probes


def _sgd_values(entry: dict[str, Any]) -> Iterable[tuple[str, list[str]]]:
    for service, state in (entry.get("final_user_state") or {}).items():
        for slot, values in (state.get("slot_values") or {}).items():
            readable = slot.replace("_", " ")
            yield (
                f"In the {service.split('_')[0]} request ({entry['conversation_id']}), what was the {readable}?",
                list(values),
            )


def _multiwoz_values(entry: dict[str, Any]) -> Iterable[tuple[str, list[str]]]:
    for domain, goal in (entry.get("goal") or {}).items():
        for part in ("info", "book"):
            for slot, value in (goal.get(part) or {}).items():
                if isinstance(value, str):
                    yield (
                        f"For the {domain} ({entry['conversation_id']}), what was the {slot}?",
                        [value],
                    )


def _usable(probe: Probe) -> bool:
    answer = probe.answer.strip()
    return len(answer) >= 3 and answer.casefold() not in _FLAGS


def _dedupe(probes: Iterable[Probe]) -> list[Probe]:
    seen: set[str] = set()
    unique = []
    for probe in probes:
        key = probe.answer.casefold()
        if key not in seen:
            seen.add(key)
            unique.append(probe)
    return unique


def _load_index(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TranscriptError(str(path), None, "no such index file") from None
    except json.JSONDecodeError as error:
        raise TranscriptError(str(path), error.lineno, f"not valid JSON ({error.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list):
        raise TranscriptError(str(path), None, 'expected an object with a "conversations" list')
    return data
