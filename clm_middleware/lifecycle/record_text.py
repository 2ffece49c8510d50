"""Plain text as records: its lines and sentences, in order.

A tool's result in plain text is data, one record after another (a log line, a flight
in a table, a search hit): cut down to some of the words of every record, it becomes
values cut loose from what they belong to ("8:30, 9:30, 10:30, 8:30" of sixty flights),
and a log that says one line a hundred times becomes that line's rarest word a hundred
times. So a result is trimmed to its leading whole records (``leading_records``), as
JSON keeps its leading items (``json_text``); and a record said again right after
itself, or said three times or more, says nothing new, so every deletion leaves it out
(``repeated_spans``).

A record ends at a newline, at ``.`` ``!`` ``?`` or ``…`` followed by whitespace (not
inside "3.5" or "e.g", nor after a list item's number: "1. Avenida Palace"), or at a
full-width ``。`` ``！`` ``？``, with the closing quotes or brackets after it; its
separator (the whitespace after it) belongs to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import regex

from clm_middleware.lifecycle.json_text import most_that_fit, parsed_container

FRAME_TIMES = 3  # a record said this often in one text is its frame or a loop, not a fact of each place
_CLOSERS = "\"')\\]」』"
_RECORD_END = regex.compile(
    # a sentence's end, followed by space; not a list item's number ("1. Avenida Palace")
    rf"(?<!(?:^|\n)[ \t]*\d{{1,3}})[.!?…]+[{_CLOSERS}]*(?:[ \t]*\n+|[ \t]+|\Z)"
    rf"|[。！？]+[{_CLOSERS}]*[ \t]*\n*"  # a full-width one: no space needed after it
    r"|\n+"  # a line's end
)


def records(text: str) -> list[tuple[int, int]]:
    """The records of ``text`` as ``(start, end)`` spans that cover it, in order."""
    spans, start = [], 0
    for end in _RECORD_END.finditer(text):
        if end.end() > start:
            spans.append((start, end.end()))
            start = end.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _key(record: str) -> str:
    return " ".join(record.casefold().split())


def repeated_spans(text: str) -> list[tuple[int, int]]:
    """The records of ``text`` that repeat an earlier one word for word (case and spacing
    aside) right after it, or that it says ``FRAME_TIMES`` times or more (a log's line, a
    loop): every such occurrence but the first. A record said twice apart is kept both
    times: a reply's "- Departure: 10:00 PM" under each of two options is a fact of each."""
    return _repeated(text, records(text))


def _repeated(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``repeated_spans`` of ``text`` given its ``records``."""
    keyed = [(start, end, _key(text[start:end])) for start, end in spans]
    times = Counter(key for _, _, key in keyed if key)
    seen: set[str] = set()
    repeated, last = [], None
    for start, end, key in keyed:
        if not key:
            continue
        if key == last or (key in seen and times[key] >= FRAME_TIMES):
            repeated.append((start, end))
        seen.add(key)
        last = key
    return repeated


def is_plain_records(text: str) -> bool:
    """Whether ``text`` is records in plain text (``leading_records`` applies): two or
    more lines or sentences, and no JSON array or object (``json_text``)."""
    return len(records(text)) >= 2 and parsed_container(text) is None


def leading_records(text: str, fits: Callable[[str], bool]) -> str | None:
    """The longest run of ``text``'s leading records, repeats left out, that ``fits``
    (right-stripped); None if ``text`` is one record said once, or not even its first
    record fits (the caller trims its words instead)."""
    spans = records(text)
    repeated = set(_repeated(text, spans))
    kept = [text[start:end] for start, end in spans if (start, end) not in repeated]
    if len(kept) < 2 and not repeated:
        return None

    def prefix(count: int) -> str:
        return "".join(kept[:count]).rstrip()

    count = most_that_fit(len(kept), lambda count: fits(prefix(count)))
    return prefix(count) if count else None
