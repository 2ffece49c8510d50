"""From generated token ids to the reply the user sees and the ids the context keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalText:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    Byte-level tokenizers can end a token in the middle of a UTF-8 character; the
    decoded tail then shows U+FFFD, which is held back until the next token completes it.
    ``text`` is what the deltas add up to: a reply cut (by ``max_new_tokens``) inside a
    character ends before that character, never with U+FFFD.
    """

    def __init__(self, tokenizer: Any, skip_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.ids: list[int] = []
        self._emitted = 0
        self._text = ""  # the complete characters of ``ids``, decoded once per push

    def push(self, token_id: int) -> str:
        if token_id not in self.skip_ids:
            self.ids.append(token_id)
            self._text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        delta, self._emitted = self._text[self._emitted :], max(self._emitted, len(self._text))
        return delta

    @property
    def text(self) -> str:
        return self._text


def cut_at_stop(text: str, stops: Sequence[str], given: int = 0) -> str:
    """``text`` up to the first stop string (the stop string itself is not shown) that
    starts at or after ``given``: the text before it was given to the model (a reply's
    opening), not written by it, and a stop string stops only what the model writes,
    as the engine matches it in generated tokens alone."""
    found = (text.find(stop, given) for stop in stops if stop)
    cut = min((at for at in found if at >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def shared_prefix_length(first: Sequence[object], second: Sequence[object]) -> int:
    """How many leading items (token ids, message keys) the two sequences have in common."""
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length
