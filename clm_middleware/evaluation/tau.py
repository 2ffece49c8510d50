"""A long session from τ-bench airline trajectories, with probes from each task's user instruction.

Each trajectory's user and assistant text messages are concatenated in task order; tool
calls, tool results and the (long, identical) airline policy system message are left out,
so that what remains is the conversation both people saw. All bundled τ-bench tasks are
held-out: no lifecycle rule was tuned on them.

Probes come mechanically from ``info.task.instruction`` (the simulated user's brief),
by value class, never picked by hand:

- the user id (``mia_li_3668``),
- dates (``May 20``), clock times (``3pm``), airport codes (``EWR``),
- a card's last digits (``your 7447 card``),
- places in ``from X to Y`` and ``reside in X`` / ``live in X`` (capitalised words).

A value becomes a probe only if the user states it in their own messages of that task
(a fact the assistant looked up is not one the user told), as a whole word, ignoring
case; answers are unique in a session (the first task that states one asks for it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import regex

from clm_middleware.errors import TranscriptError
from clm_middleware.evaluation.probes import Probe
from clm_middleware.evaluation.sessions import Session

SYSTEM = "You are a helpful airline customer-service agent."
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_PLACE = r"[A-Z][a-z]+(?: [A-Z][a-z]+)?"
# (question about the value, pattern whose group 1 is the value)
_VALUE_CLASSES: tuple[tuple[str, str], ...] = (
    ("what was the customer's user id", r"\b([a-z]+_[a-z]+_\d{4})\b"),
    ("on what date did the customer want to travel", rf"\b((?:{_MONTHS}) \d{{1,2}})\b"),
    ("what departure time did the customer mention", r"\b(\d{1,2}(?:am|pm))\b"),
    ("which airport code did the customer mention", r"\b([A-Z]{3})\b"),
    ("what were the last digits of the customer's card", r"\b(\d{4}) card\b"),
    ("where was the customer flying from", rf"\bfrom ({_PLACE}) to {_PLACE}"),
    ("where was the customer flying to", rf"\bfrom {_PLACE} to ({_PLACE})"),
    ("where does the customer live", rf"\b(?:reside|live) in ({_PLACE})"),
)
_ORDINALS = {"1": "st", "2": "nd", "3": "rd"}


def build_tau_session(trajectories_path: str | Path, *, system: str | None = SYSTEM) -> Session:
    """Every trajectory of ``trajectories_path`` (a τ-bench ``historical_trajectories`` JSON list) in order."""
    path = Path(trajectories_path)
    records = _load(path)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    probes: list[Probe] = []
    seen: set[str] = set()
    ids = []
    for number, record in enumerate(records):
        task_id, instruction, trajectory = _fields(record, path, number)
        turns = [
            {"role": m["role"], "content": m["content"].strip()}
            for m in trajectory
            if isinstance(m, dict)
            and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str)
            and m["content"].strip()
        ]
        messages += turns
        ids.append(f"tau-airline-{task_id}")
        said = "\n".join(m["content"] for m in turns if m["role"] == "user")
        for probe in instruction_probes(task_id, instruction):
            if probe.answer.casefold() not in seen and probe.retained_in(said):
                seen.add(probe.answer.casefold())
                probes.append(probe)
    origin = {"dataset": "tau-airline", "split": "held-out", "source": str(path)}
    return Session(messages, probes, tuple(ids), origin)


def instruction_probes(task_id: object, instruction: str) -> Iterator[Probe]:
    """One probe per value of each class in ``instruction``, in class order then text order."""
    for question, pattern in _VALUE_CLASSES:
        for value in _unique(m.group(1) for m in regex.finditer(pattern, instruction)):
            yield Probe(f"In airline task {task_id}, {question}?", value, _spellings(value))


def _spellings(value: str) -> tuple[str, ...]:
    """A date is also said with its ordinal suffix ("May 20th"); other values have one spelling."""
    if regex.fullmatch(rf"(?:{_MONTHS}) \d{{1,2}}", value):
        day = value.rsplit(" ", 1)[1]
        suffix = "th" if day in ("11", "12", "13") else _ORDINALS.get(day[-1], "th")
        return (value + suffix,)
    return ()


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _load(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TranscriptError(str(path), None, "no such τ-bench trajectories file") from None
    except json.JSONDecodeError as error:
        raise TranscriptError(str(path), error.lineno, f"not valid JSON ({error.msg})") from None
    if not isinstance(data, list) or not data:
        raise TranscriptError(str(path), None, 'expected a non-empty list of {"task_id", "info", "traj"} records')
    return data


def _fields(record: Any, path: Path, number: int) -> tuple[object, str, list[dict[str, Any]]]:
    try:
        task_id = record["task_id"]
        instruction = record["info"]["task"]["instruction"]
        trajectory = record["traj"]
    except (KeyError, TypeError):
        raise TranscriptError(
            str(path), None, f"record {number}: needs task_id, info.task.instruction and traj"
        ) from None
    if not isinstance(instruction, str) or not isinstance(trajectory, list):
        raise TranscriptError(str(path), None, f"record {number}: instruction must be text and traj a list")
    return task_id, instruction, trajectory
