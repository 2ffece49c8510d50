"""Which messages can still change what a turn does (the live index).

A message is live while one of its segments is shown, labelled for a change that has
not taken effect (pending), or was removed within the last K rounds (a reference or the
model's relabel can still bring it back). Past that, only ``pin`` can bring a segment
back, and it calls ``restore``. Everything a turn scans (tagging candidates, the
restore test, compaction, attention decay) scans live messages only, so over a long
history a turn's cost follows the context, not the number of messages ever said.

Invariants: ``messages()`` is a superset of the live messages, in message order. It
shrinks only in ``refresh``, which runs at the start of a turn, when every segment
removed in an earlier turn has its ``removed_round``; between refreshes it only grows
(a segment dropped in the middle of a turn stays listed).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from clm_middleware.lifecycle.segments import MessageRecord, Segment, SegmentId


class LiveIndex:
    def __init__(self, k: int) -> None:
        self._k = k
        self._indices: list[int] = []  # live messages among the checked ones, ascending
        self._checked = 0  # messages before this index were checked by the last refresh

    def messages(self, history: Sequence[MessageRecord]) -> list[MessageRecord]:
        """The live messages of ``history``, with every message added since the last refresh."""
        return [*(history[i] for i in self._indices), *history[self._checked :]]

    def refresh(self, history: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment], turn: int) -> None:
        """Drop the messages that nothing can bring back by ``turn``; cost: the live ones."""
        candidates = [*self._indices, *range(self._checked, len(history))]
        self._indices = [i for i in candidates if any(self._live(segments[s], turn) for s in history[i].segment_ids)]
        self._checked = len(history)

    def truncate(self, length: int) -> None:
        """The history lost its messages from ``length`` on (``Conversation.discard``)."""
        self._indices = [i for i in self._indices if i < length]
        self._checked = min(self._checked, length)

    def restore(self, message_index: int) -> None:
        """A segment of this message shows again (``pin`` of a long-removed segment)."""
        if message_index < self._checked:
            position = bisect.bisect_left(self._indices, message_index)
            if position == len(self._indices) or self._indices[position] != message_index:
                self._indices.insert(position, message_index)

    def _live(self, segment: Segment, turn: int) -> bool:
        return segment.visible or segment.pending or recently_removed(segment, turn, self._k)


def recently_removed(segment: Segment, turn: int, k: int) -> bool:
    """Removed within the last ``k`` rounds: its blocks are still held, and a reference
    or the model's relabel can bring it back."""
    return segment.removed_round is not None and turn - segment.removed_round <= k
