"""What of a reply the user may see, computed on the whole text so far (streaming-safe).

The visible answer is the model's output before a ``[LIFECYCLE]`` block (when the
protocol is in use) and before any stop string, right-stripped. While streaming, a
suffix that could still turn into a tag or a stop string is held back, so the user
never sees a block, or half of one, even for a single delta.
"""

from __future__ import annotations

from collections.abc import Sequence

import regex

from clm_middleware.lifecycle.protocol import split_reply
from clm_middleware.lifecycle.reply import cut_at_stop

_OPEN_TAG_FOLDED = "[lifecycle]"


def visible_answer(raw: str, *, protocol: bool, stops: Sequence[str]) -> str:
    answer = split_reply(raw)[0] if protocol else raw
    return cut_at_stop(answer, stops).rstrip()


class ReplyFilter:
    def __init__(self, *, protocol: bool, stops: Sequence[str]) -> None:
        self.protocol, self.stops = protocol, tuple(s for s in stops if s)
        self._emitted = 0

    def delta(self, raw_so_far: str) -> str:
        """New visible text since the last call."""
        answer = split_reply(raw_so_far)[0] if self.protocol else raw_so_far
        answer = cut_at_stop(answer, self.stops)
        safe = len(answer) - self._held_suffix(answer)
        if safe <= self._emitted:
            return ""
        text, self._emitted = answer[self._emitted : safe], safe
        return text

    def finish(self, final_answer: str) -> str:
        """The rest of ``final_answer`` once the generation is over."""
        text = final_answer[self._emitted :] if len(final_answer) > self._emitted else ""
        self._emitted = max(self._emitted, len(final_answer))
        return text

    def _held_suffix(self, answer: str) -> int:
        """Characters at the end that might still become a tag or a stop string, with the
        whitespace before them (the final answer is right-stripped before either)."""
        cut = len(answer.rstrip())  # trailing whitespace is always held
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(answer)), 0, -1):
                if stop.startswith(answer[-size:]):
                    cut = min(cut, len(answer[:-size].rstrip()))
                    break
        if self.protocol:
            bracket = answer.rfind("[")
            if bracket >= 0:
                compact = regex.sub(r"\s+", "", answer[bracket:]).casefold()
                if _OPEN_TAG_FOLDED.startswith(compact) and len(answer) - bracket < 32:
                    cut = min(cut, len(answer[:bracket].rstrip()))
        return len(answer) - cut
