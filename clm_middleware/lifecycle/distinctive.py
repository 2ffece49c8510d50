"""Distinctive tokens: the words a compression must never lose or invent.

Numbers, codes, emails, URLs, dates and names carry the facts of a conversation
("order 88412", "QX7-4821", "April 22", "Casa do Jardim"). They are found by rules,
not by the model, so the check is the same for every model and cannot be argued with.
"""

from __future__ import annotations

import regex

_EMAIL = r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
_URL = r"https?://\S+|www\.\S+"
# A code mixes letters and digits, or is a digit group with separators (QX7-4821, 10:40, 2,400, 3.5)
_CODE = r"(?:\p{L}+[-_/]?)*\p{N}+(?:[-_/.:,]?[\p{L}\p{N}]+)*"
_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
_NAME = r"\p{Lu}[\p{Ll}\p{Lu}'’-]*\p{L}"
_TOKEN = regex.compile(rf"(?P<email>{_EMAIL})|(?P<url>{_URL})|(?P<code>{_CODE})|(?P<name>{_NAME})", regex.V1)
_MONTH = regex.compile(rf"^(?:{_MONTHS})$", regex.IGNORECASE)
_SENTENCE_START = regex.compile(r"(?:^|[.!?…:;\n]\s*|[\"“(]\s*)$")
_COMMON_CAPITALISED = frozenset(
    [
        "I",
        "I'm",
        "I've",
        "I'll",
        "I'd",
        "OK",
        "Ok",
        "Okay",
        "Yes",
        "No",
        "Hi",
        "Hello",
        "Hey",
        "Thanks",
        "Please",
        "Sorry",
        "Sure",
        "The",
        "A",
        "An",
    ]
)


def distinctive_tokens(text: str) -> set[str]:
    """The distinctive tokens of ``text``, normalised (case-folded, trailing punctuation cut)."""
    found: set[str] = set()
    for match in _TOKEN.finditer(text):
        kind, value = match.lastgroup, match.group()
        if kind == "name":
            if value in _COMMON_CAPITALISED:
                continue
            if _SENTENCE_START.search(text[: match.start()]) and not _MONTH.match(value):
                continue  # a capitalised first word is grammar, not a name
        elif kind == "code" and not any(ch.isdigit() for ch in value):
            continue
        found.add(normalise(value))
    return found


def normalise(token: str) -> str:
    return token.casefold().rstrip(".,;:!?)\"'’”")


def has_distinctive(text: str) -> bool:
    return bool(distinctive_tokens(text))


def missing_from(required: set[str], text: str) -> set[str]:
    """Which of ``required`` do not occur in ``text`` (case-insensitive substring match)."""
    haystack = text.casefold()
    return {token for token in required if token not in haystack}
