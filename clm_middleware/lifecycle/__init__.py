"""The lifecycle layer: segments, labels, compression, reclamation."""

from clm_middleware.lifecycle.config import GenerationSettings, LifecycleConfig
from clm_middleware.lifecycle.segmenter import Segmenter
from clm_middleware.lifecycle.segments import (
    DecidedBy,
    Decision,
    Label,
    MessageRecord,
    Segment,
    SegmentId,
    Status,
)
from clm_middleware.lifecycle.tagging import TAGGING_MODES, TaggingConfig
from clm_middleware.lifecycle.turn import Reply, TurnStats

__all__ = [
    "TAGGING_MODES",
    "DecidedBy",
    "Decision",
    "GenerationSettings",
    "Label",
    "LifecycleConfig",
    "MessageRecord",
    "Reply",
    "Segment",
    "SegmentId",
    "Segmenter",
    "Status",
    "TaggingConfig",
    "TurnStats",
]
