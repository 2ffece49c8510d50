"""Retention probes: ``[{"question", "answer"}]``; a probe is retained when its answer is in the context."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from clm_middleware.errors import TranscriptError
from clm_middleware.lifecycle.segmenter import UNSPACED_SCRIPTS


@dataclass(frozen=True, slots=True)
class Probe:
    question: str
    answer: str
    alternatives: tuple[str, ...] = field(default=())  # other spellings that count as the answer

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.answer, *self.alternatives)

    def retained_in(self, text: str) -> bool:
        """Any answer occurs in ``text`` as a whole word or phrase, ignoring case."""
        return any(_occurs(answer, text) for answer in self.answers)

    def as_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"question": self.question, "answer": self.answer}
        if self.alternatives:
            data["alternatives"] = list(self.alternatives)
        return data


# what may not touch an answer for it to count as said: a letter of a script written
# with spaces between words, or a digit ("1234" is not said in "CA1234"); Chinese and
# Japanese write words without spaces, so a letter of theirs bounds nothing
# ("航班CA1234在" says "CA1234")
_IN_WORD = rf"[[\p{{L}}--[{UNSPACED_SCRIPTS}]]\p{{N}}]"


def _occurs(answer: str, text: str) -> bool:
    if not answer.strip():
        return False
    pattern = rf"(?<!{_IN_WORD})" + regex.escape(answer.strip()) + rf"(?!{_IN_WORD})"
    return regex.search(pattern, text, regex.IGNORECASE | regex.V1) is not None


_PROBE_KEYS = frozenset({"question", "answer", "alternatives"})


def read_probes(path: str | Path) -> list[Probe]:
    """The probes of a JSON file: a non-empty list of ``{"question", "answer"}`` objects,
    each with optional ``"alternatives"`` (a list of strings) and no other key. Anything
    else is a ``TranscriptError`` naming the file and the probe."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as Windows editors write: as transcripts
    except FileNotFoundError:
        raise TranscriptError(str(path), None, "no such probes file") from None
    except IsADirectoryError:
        raise TranscriptError(str(path), None, "is a directory, not a probes file") from None
    except UnicodeDecodeError:
        raise TranscriptError(str(path), None, "not UTF-8 text (a probes file is JSON)") from None
    except OSError as error:
        raise TranscriptError(str(path), None, f"cannot be read ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise TranscriptError(str(path), error.lineno, f"not valid JSON ({error.msg})") from None
    if not isinstance(data, list) or not data:
        raise TranscriptError(str(path), None, 'expected a non-empty list like [{"question": ..., "answer": ...}]')
    probes = []
    for number, item in enumerate(data):
        known = ", ".join(f'"{key}"' for key in sorted(_PROBE_KEYS))
        if not isinstance(item, dict) or not isinstance(item.get("answer"), str) or not item["answer"].strip():
            found = f" (it has {', '.join(map(repr, item))}; a probe has {known})" if isinstance(item, dict) else ""
            raise TranscriptError(str(path), None, f'probe {number}: needs a non-empty string "answer"{found}')
        if unknown := sorted(set(item) - _PROBE_KEYS):  # a misspelt "alternatives" would count nothing
            raise TranscriptError(str(path), None, f"probe {number}: unknown key {unknown[0]!r} (a probe has {known})")
        alternatives = item.get("alternatives") or []
        if not isinstance(alternatives, list) or not all(isinstance(a, str) for a in alternatives):
            raise TranscriptError(str(path), None, f'probe {number}: "alternatives" must be a list of strings')
        question = item.get("question", "")
        if not isinstance(question, str):
            raise TranscriptError(str(path), None, f'probe {number}: "question" must be a string')
        probes.append(Probe(question, item["answer"], tuple(alternatives)))
    return probes


def write_probes(path: str | Path, probes: list[Probe]) -> None:
    Path(path).write_text(
        json.dumps([p.as_dict() for p in probes], indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )


def said_context(drivers: Sequence[Any]) -> str:
    """The final contexts of replay ``drivers`` (each with ``context`` and
    ``tools_section``, as the context shows it) as one text, without the tools section each shows in its system
    message: an answer that only the middleware's own instructions hold (its example call
    names "Paris") was not retained from the conversation."""
    contexts = []
    for driver in drivers:
        context, section = driver.context, driver.tools_section
        contexts.append(context.replace(section, "", 1) if section else context)
    return "\n".join(contexts)


def retention(probes: list[Probe], context: str) -> tuple[int, list[Probe]]:
    """How many probes the context retains, and which are lost."""
    lost = [p for p in probes if not p.retained_in(context)]
    return len(probes) - len(lost), lost
