"""The units the lifecycle layer decides about: segments of messages, and decisions on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

SegmentId = NewType("SegmentId", str)  # "seg_N", unique within a conversation, never reused


class Label(str, Enum):
    KEEP = "keep"
    COMPRESS = "compress"
    DROP = "drop"


class Status(str, Enum):
    ACTIVE = "active"  # in the context as written
    COMPRESSED = "compressed"  # in the context as its summary; the original stays in the store
    DROPPED = "dropped"  # out of the context; the original stays in the store


class DecidedBy(str, Enum):
    MODEL = "model"  # the model's own [LIFECYCLE] block
    CONSTRAINED = "constrained"  # the model's logits over keep / compress / drop
    SIGNALS = "signals"  # the model's computation: self-information, attention
    RULES = "rules"  # fallback rules, budget pressure, user actions


KINDS = ("system", "question", "step", "code", "ack", "text", "tool", "reply", "loop")
LOOP_KIND = "loop"  # a generated reply that is a repetition loop (see reply_quality.py): never context
PEAK_TOKENS = 3  # a segment's peak self-information: the mean of its most surprising tokens


def segment_id(index: int) -> SegmentId:
    return SegmentId(f"seg_{index}")


@dataclass(slots=True)
class Segment:
    """One piece of one message.

    Invariants: ``token_ids`` never change after creation (prefix stability); what
    the context shows is ``token_ids`` while ACTIVE, ``summary_ids`` while COMPRESSED,
    nothing while DROPPED. ``label`` is the latest decision; it takes effect when the
    conversation next compacts (see ``Conversation``), so it can differ from ``status``.
    """

    id: SegmentId
    index: int
    message_index: int
    role: str
    kind: str
    text: str
    token_ids: list[int]
    separator: str = ""  # whitespace that preceded it in its message
    turn: int = 0
    pinned: bool = False
    status: Status = Status.ACTIVE
    label: Label = Label.KEEP
    decided_by: DecidedBy | None = None
    summary: str | None = None
    summary_ids: list[int] | None = None
    summary_method: str | None = None
    surprisal: list[float | None] | None = None  # -log p per token (None where not scored), when first computed
    attention: float = 0.0  # decayed attention mass the newest turns paid to it
    removed_round: int | None = None  # round it left the context (for K-round reclamation)

    @property
    def visible(self) -> bool:
        return self.status is not Status.DROPPED

    @property
    def visible_ids(self) -> list[int]:
        if self.status is Status.COMPRESSED and self.summary_ids is not None:
            return self.summary_ids
        return self.token_ids if self.visible else []

    @property
    def visible_text(self) -> str:
        if self.status is Status.COMPRESSED and self.summary is not None:
            return self.summary
        return self.text if self.visible else ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def pending(self) -> bool:
        """Labelled for a change that has not taken effect yet."""
        return (self.label is Label.DROP and self.status is not Status.DROPPED) or (
            self.label is Label.COMPRESS and self.status is Status.ACTIVE
        )

    @property
    def mean_surprisal(self) -> float | None:
        values = self._scored()
        return sum(values) / len(values) if values else None

    @property
    def peak_surprisal(self) -> float:
        """Mean of the ``PEAK_TOKENS`` most surprising tokens where it was said (0 unscored)."""
        values = sorted(self._scored(), reverse=True)[:PEAK_TOKENS]
        return sum(values) / len(values) if values else 0.0

    def _scored(self) -> list[float]:
        return [v for v in self.surprisal or () if v is not None]


@dataclass(slots=True)
class MessageRecord:
    """Everything said, complete, whatever the context keeps of it."""

    index: int
    role: str
    content: str
    turn: int
    segment_ids: list[SegmentId] = field(default_factory=list)
    raw_output: str | None = None  # the model's full output, lifecycle block included


# how the reason of a user's own decision ends ("pinned by user", "forgotten by user"): clm stats reads it
BY_USER = " by user"


@dataclass(frozen=True, slots=True)
class Decision:
    turn: int
    segment_id: SegmentId
    label: Label
    decided_by: DecidedBy
    reason: str = ""
    confidence: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "turn": self.turn,
            "segment_id": self.segment_id,
            "label": self.label.value,
            "decided_by": self.decided_by.value,
            "reason": self.reason,
            "confidence": self.confidence,
        }
