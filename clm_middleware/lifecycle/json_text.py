"""A JSON text made shorter without cutting it word by word.

A tool's result is often JSON (a search's records, a user's profile). Cut word by word
it becomes ``{"flight_number": "origin": "scheduled_departure_time_est": ...`` — keys
without values, records run together, and a digest line the model reads as broken code.
Here it is either

- condensed (``json_facts``): every key and value kept, in order, without the syntax
  (quotes, braces), ``name: (first_name: Mia, last_name: Li), reservations: (NO6JO3;
  AIXC49)``: every fact stays, with the name that gives it its meaning; or
- trimmed (``json_prefix``): its leading items whole, still JSON. It says less, never
  something else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def dump(value: Any) -> str:
    """One line, spaced as JSON is commonly written (``{"a": 1, "b": 2}``)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def parsed_container(text: str) -> list | dict | None:
    """``text`` parsed, if it is a JSON array or object; None otherwise."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, list | dict) else None


def most_that_fit(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest count in ``1..limit`` of leading items that ``fits`` (monotone: fewer
    items fit whenever more do); 0 when not even one does (``fits(0)`` is never asked)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def json_facts(text: str) -> str | None:
    """``text``'s JSON array or object as ``key: value`` pairs, every key and leaf value
    in order, nested containers in parentheses, list items separated by ``;``. None if
    ``text`` is no JSON array or object."""
    value = parsed_container(text)
    return _facts(value) if value else None


def _facts(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key}: {_nested(item)}" for key, item in value.items())
    if isinstance(value, list):
        return "; ".join(_nested(item) for item in value)
    return value if isinstance(value, str) else json.dumps(value)


def _nested(value: Any) -> str:
    if isinstance(value, list | dict):
        return f"({_facts(value)})" if value else json.dumps(value)
    return _facts(value)


def json_prefix(text: str, fits: Callable[[str], bool]) -> str | None:
    """The longest prefix of ``text``'s JSON array or object, by whole items, whose
    ``dump`` ``fits``; where not even one top-level item fits, its first item trimmed
    the same way. None if ``text`` is no JSON array or object, or nothing fits."""
    value = parsed_container(text)
    if value is None:
        return None
    kept = _prefix(value, fits)
    return None if kept is None else dump(kept)


def _prefix(value: Any, fits: Callable[[str], bool]) -> Any | None:
    if fits(dump(value)):
        return value
    if not isinstance(value, list | dict) or not value:
        return None
    items = list(value.items()) if isinstance(value, dict) else list(value)

    def rebuild(part: list) -> Any:
        return dict(part) if isinstance(value, dict) else part

    # the whole does not fit: the most leading items that do
    low = most_that_fit(len(items) - 1, lambda count: fits(dump(rebuild(items[:count]))))
    if low > 0:
        return _with_next_trimmed(value, items, low, fits)
    first = items[0]
    if isinstance(value, dict):  # {"key": <first value trimmed>}
        key, inner = first
        trimmed = _value_trimmed({}, key, inner, fits)
        return None if trimmed is None else {key: trimmed}
    trimmed = _prefix(first, lambda t: fits("[" + t + "]"))
    return None if trimmed is None else [trimmed]


def _with_next_trimmed(value: dict | list, items: list, low: int, fits: Callable[[str], bool]) -> Any:
    """The ``low`` leading items of an object, and its next value trimmed into the room
    they leave where that value is an array or object: ``{"date": ..., "events": [the
    first k]}``, not ``{"date": ...}`` alone (a calendar of 30 events had lost every event
    in a prompt half empty: a helper's probe). An array's next item is not cut: records
    stay whole."""
    if not isinstance(value, dict):
        return items[:low]
    key, inner = items[low]
    kept = dict(items[:low])
    if not isinstance(inner, list | dict) or not inner:
        return kept
    trimmed = _value_trimmed(kept, key, inner, fits)
    return kept if trimmed is None else {**kept, key: trimmed}


def _value_trimmed(kept: dict, key: str, inner: Any, fits: Callable[[str], bool]) -> Any | None:
    """``inner`` trimmed (``_prefix``) to fit as ``key``'s value after the items of
    ``kept``; None if nothing of it fits."""
    opening = dump(kept)[:-1] + (", " if kept else "") + json.dumps(key, ensure_ascii=False) + ": "
    return _prefix(inner, lambda t: fits(opening + t + "}"))
