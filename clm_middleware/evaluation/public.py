"""Long sessions with probes from public task-oriented dialogues (SGD, MultiWOZ).

Several dialogues are concatenated into one conversation, so that it outgrows a
context budget. Probes come from each dataset's own ground truth: SGD's final user
state (the slot values the user asked for), MultiWOZ's user goal (constraints and
booking details). A value becomes a probe only if it occurs in the session's text as
a whole word (otherwise even keeping everything could not retain it) and is at least
three characters long and not a yes/no flag (a single digit or "true" would match
by accident).

Held-out discipline: the dialogues are split into ``tuning`` and ``held-out`` by
dialogue id. ``TUNING_DIALOGUES`` are exactly the dialogues of the two sessions the
lifecycle rules were tuned on (``examples/retention/{sgd,multiwoz}_session_10.jsonl``,
drawn with seed 0 before the split existed); every other dialogue of the bundled data is
held-out. A held-out session never contains a tuning dialogue, and held-out sessions of
one seed with different ``part`` never share a dialogue: the held-out pool is shuffled
once by ``seed`` and part ``k`` takes the ``k``-th run of ``dialogues`` dialogues.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clm_middleware.errors import TranscriptError
from clm_middleware.evaluation.probes import Probe
from clm_middleware.evaluation.sessions import Session
from clm_middleware.replay.transcript import read_jsonl

DATASETS = ("sgd", "multiwoz")
SPLITS = ("all", "tuning", "held-out")
# The tuning sessions' dialogues, in session order: random.Random(0).sample(index entries, 10).
# Spelled out, not recomputed, so that the split cannot drift with the sampling code.
TUNING_DIALOGUES: dict[str, tuple[str, ...]] = {
    "sgd": (
        "sgd-test-21_00067",
        "sgd-test-34_00013",
        "sgd-test-24_00011",
        "sgd-test-5_00126",
        "sgd-test-20_00003",
        "sgd-test-25_00020",
        "sgd-test-24_00125",
        "sgd-test-21_00117",
        "sgd-test-20_00057",
        "sgd-test-24_00114",
    ),
    "multiwoz": (
        "multiwoz-test-PMUL1087",
        "multiwoz-test-SNG0840",
        "multiwoz-test-PMUL1329",
        "multiwoz-test-MUL0528",
        "multiwoz-test-MUL2316",
        "multiwoz-test-PMUL2497",
        "multiwoz-test-PMUL2437",
        "multiwoz-test-PMUL1284",
        "multiwoz-test-PMUL0076",
        "multiwoz-test-PMUL2286",
    ),
}
_FLAGS = {"true", "false", "yes", "no", "none", "dontcare", "not mentioned"}


def build_session(
    dataset: str,
    index_path: str | Path,
    transcripts_path: str | Path,
    *,
    dialogues: int = 10,
    seed: int = 0,
    split: str = "all",
    part: int = 0,
    system: str | None = "You are a helpful booking assistant.",
) -> Session:
    """One long session of ``dialogues`` dialogues drawn with ``seed`` from ``split``, and its probes.

    ``all`` samples from every dialogue (how the tuning sessions were drawn); ``tuning`` is
    ``TUNING_DIALOGUES`` in order (``dialogues``, ``seed`` and ``part`` do not apply);
    ``held-out`` is part ``part`` of the seeded shuffle of the other dialogues.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    if part < 0 or (part and split != "held-out"):
        raise ValueError("part: a non-negative number, and only for the held-out split")
    index = _load_index(Path(index_path))
    by_id = {t.conversation_id: t for t in read_jsonl(transcripts_path)}
    entries = [entry for entry in index["conversations"] if entry["conversation_id"] in by_id]
    if not entries:
        raise TranscriptError(str(transcripts_path), None, "no dialogue of the index is in this transcript file")
    chosen = _choose(dataset, index_path, entries, dialogues=dialogues, seed=seed, split=split, part=part)
    if not chosen:
        raise ValueError(f"part: held-out {dataset} has no dialogues left for part {part} of {dialogues}")
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
    origin = {"dataset": dataset, "split": split, "seed": seed, "part": part, "count": dialogues}
    return Session(messages, probes, tuple(entry["conversation_id"] for entry in chosen), origin)


def held_out_ids(dataset: str, all_ids: Iterable[str]) -> list[str]:
    """The ids of ``all_ids`` that are not tuning dialogues of ``dataset``, in their order."""
    tuning = set(TUNING_DIALOGUES[dataset])
    return [i for i in all_ids if i not in tuning]


def _choose(
    dataset: str,
    index_path: str | Path,
    entries: list[dict[str, Any]],
    *,
    dialogues: int,
    seed: int,
    split: str,
    part: int,
) -> list[dict[str, Any]]:
    if split == "all":
        return random.Random(seed).sample(entries, min(dialogues, len(entries)))
    by_id = {entry["conversation_id"]: entry for entry in entries}
    if split == "tuning":
        missing = [i for i in TUNING_DIALOGUES[dataset] if i not in by_id]
        if missing:
            raise TranscriptError(
                str(index_path), None, f"tuning dialogues missing from the data: {', '.join(missing)}"
            )
        return [by_id[i] for i in TUNING_DIALOGUES[dataset]]
    pool = [by_id[i] for i in held_out_ids(dataset, by_id)]
    shuffled = random.Random(seed).sample(pool, len(pool))
    return shuffled[part * dialogues : (part + 1) * dialogues]


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
    for number, entry in enumerate(data["conversations"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("conversation_id"), str):
            raise TranscriptError(
                str(path), None, f'conversations[{number}]: expected an object with a string "conversation_id"'
            )
    return data
