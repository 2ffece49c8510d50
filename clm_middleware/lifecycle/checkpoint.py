"""What a turn changes in a conversation before its reply is recorded, kept so that a
failed turn can put it back.

A turn restores referenced segments, applies pending labels and, under budget pressure,
drops and condenses segments and moves the fold, all before it generates. If the turn
then fails (the new message cannot fit even after all that, the engine fails, the caller
cancels), the conversation must read as it did before the call: the older turns shown as
they were, not dropped for a message that was never answered.

Invariant: :meth:`TurnCheckpoint.restore` gives every segment the checkpoint saw the
lifecycle fields it had (status, label, who decided it, summary, removal round) and the
conversation its fold. Block holds taken meanwhile are not undone: a hold only keeps
blocks cached for K rounds, which is harmless for a segment shown again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from clm_middleware.lifecycle.segments import DecidedBy, Label, Segment, SegmentId, Status


@dataclass(frozen=True, slots=True)
class SegmentState:
    """The fields of a segment that a turn's lifecycle steps may change."""

    status: Status
    label: Label
    decided_by: DecidedBy | None
    summary: str | None
    summary_ids: list[int] | None
    summary_method: str | None
    removed_round: int | None

    @classmethod
    def of(cls, segment: Segment) -> SegmentState:
        summary_ids = None if segment.summary_ids is None else list(segment.summary_ids)
        return cls(
            segment.status,
            segment.label,
            segment.decided_by,
            segment.summary,
            summary_ids,
            segment.summary_method,
            segment.removed_round,
        )

    def put_back(self, segment: Segment) -> bool:
        """Give ``segment`` these fields; True if any of them differed."""
        if SegmentState.of(segment) == self:
            return False
        segment.status, segment.label, segment.decided_by = self.status, self.label, self.decided_by
        segment.summary, segment.summary_ids = self.summary, self.summary_ids
        segment.summary_method, segment.removed_round = self.summary_method, self.removed_round
        return True


@dataclass(frozen=True, slots=True)
class TurnCheckpoint:
    fold: int
    states: dict[SegmentId, SegmentState]

    @classmethod
    def take(cls, segments: Iterable[Segment], fold: int) -> TurnCheckpoint:
        """The state of ``segments`` (every segment the turn may change) and the fold."""
        return cls(fold, {segment.id: SegmentState.of(segment) for segment in segments})

    def restore(self, segments: Mapping[SegmentId, Segment]) -> list[SegmentId]:
        """Put the saved fields back on ``segments``; the ids of those that had changed."""
        return [
            identifier
            for identifier, state in self.states.items()
            if identifier in segments and state.put_back(segments[identifier])
        ]
