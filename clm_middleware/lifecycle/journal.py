"""What a conversation changed since its last save.

Invariants:
- Every message and segment id it holds belongs to the conversation that owns it; a
  discarded message leaves it with its segments (``forget``), and the store's rows of
  it (a ``close()`` may have saved it unanswered) go with the next save.
- ``saved`` is the only way it empties otherwise, once the store committed what
  ``pending`` handed over: the messages from the first unsaved one to the last (an
  unsaved message may precede saved ones after a fork).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from clm_middleware.lifecycle.segments import Decision, MessageRecord, Segment, SegmentId
from clm_middleware.store.records import ConversationChanges


class ChangeJournal:
    def __init__(self) -> None:
        self._first_message: int | None = None
        self._decisions: list[Decision] = []
        self._segments: set[SegmentId] = set()
        self._cut_at: int | None = None  # stored messages from this index on were discarded
        self._cut_segments: set[SegmentId] = set()  # and these segments with them

    def message(self, message: MessageRecord) -> None:
        """A message was added or changed."""
        if self._first_message is None or message.index < self._first_message:
            self._first_message = message.index

    def segment(self, segment: SegmentId) -> None:
        """A segment was added or changed (status, label, summary, pin)."""
        self._segments.add(segment)

    def decisions(self, decisions: Iterable[Decision]) -> None:
        self._decisions.extend(decisions)

    def everything(self, messages: Sequence[MessageRecord]) -> None:
        """Every message and segment is unsaved: a conversation new to its store."""
        for message in messages:
            self.message(message)
            self._segments.update(message.segment_ids)

    def forget(self, messages: Sequence[MessageRecord]) -> None:
        """The messages from ``messages[0]`` on are gone, unsaved (``Conversation.discard``)."""
        if not messages:
            return
        for message in messages:
            self._segments.difference_update(message.segment_ids)
            self._cut_segments.update(message.segment_ids)
        start = messages[0].index
        self._cut_at = start if self._cut_at is None else min(self._cut_at, start)
        if self._first_message is not None and self._first_message >= messages[0].index:
            self._first_message = None

    @property
    def empty(self) -> bool:
        """Nothing changed since the last save."""
        return self._first_message is None and not self._decisions and not self._segments and self._cut_at is None

    def pending(self, messages: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment]) -> ConversationChanges:
        """What changed, read from the conversation's ``messages`` and ``segments``; the
        journal keeps it until ``saved``: a save that fails leaves it for the next one."""
        first = self._first_message
        return ConversationChanges(
            messages=[] if first is None else [m for m in messages if m.index >= first],
            segments=[segments[s] for s in sorted(self._segments, key=_index)],
            decisions=list(self._decisions),
            cut_at=self._cut_at,
            cut_segments=sorted(self._cut_segments, key=_index),
        )

    def saved(self) -> None:
        """What ``pending`` returned is in the store now."""
        self._first_message = None
        self._decisions.clear()
        self._segments.clear()
        self._cut_at = None
        self._cut_segments.clear()


def _index(segment: SegmentId) -> int:
    return int(segment.split("_")[1])
