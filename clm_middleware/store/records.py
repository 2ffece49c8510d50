"""What the store writes and reads back, as plain data: the store knows no ``Conversation``.

Invariants:
- A ``ConversationRecord`` is one row of ``conversations``; ``settings`` and
  ``parse_history`` are JSON-able.
- ``ConversationChanges.messages`` runs from the first message changed since the last save
  to the last message, in index order, so rows written earlier after it are overwritten.
- ``StoredConversation`` holds every message and segment of one conversation, in index
  order: what rebuilding it needs, and nothing derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clm_middleware.lifecycle.segments import Decision, MessageRecord, Segment, SegmentId


@dataclass(frozen=True)
class ConversationRecord:
    """A conversation's own row: the counters and settings it is rebuilt with."""

    id: str
    model: str
    settings: dict[str, Any]
    turn: int
    next_index: int
    fold: int
    protocol_context: bool
    parse_history: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class ConversationChanges:
    """What changed since the last save: written in one transaction."""

    messages: list[MessageRecord] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    # discarded since the last save: the stored messages from this index on, and these
    # segments of theirs, go before ``messages`` are written (which may reuse the indexes)
    cut_at: int | None = None
    cut_segments: list[SegmentId] = field(default_factory=list)


@dataclass(frozen=True)
class StoredConversation:
    """One conversation as stored."""

    record: ConversationRecord
    messages: list[MessageRecord]
    segments: list[Segment]
    turn_stats: list[dict[str, Any]] = field(default_factory=list)  # each turn's TurnStats.as_dict(), in order
