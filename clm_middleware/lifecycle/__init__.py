"""The lifecycle layer: segments, labels, compression, reclamation (names imported on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clm_middleware.lazy import lazy_namespace

_EXPORTS = {
    "DecidedBy": "clm_middleware.lifecycle.segments",
    "Decision": "clm_middleware.lifecycle.segments",
    "GenerationSettings": "clm_middleware.lifecycle.config",
    "Label": "clm_middleware.lifecycle.segments",
    "LifecycleConfig": "clm_middleware.lifecycle.config",
    "MessageRecord": "clm_middleware.lifecycle.segments",
    "Reply": "clm_middleware.lifecycle.turn",
    "Segment": "clm_middleware.lifecycle.segments",
    "SegmentId": "clm_middleware.lifecycle.segments",
    "Segmenter": "clm_middleware.lifecycle.segmenter",
    "Status": "clm_middleware.lifecycle.segments",
    "TAGGING_MODES": "clm_middleware.lifecycle.modes",
    "TaggingConfig": "clm_middleware.lifecycle.tagging",
    "TurnStats": "clm_middleware.lifecycle.turn",
}

if TYPE_CHECKING:
    from clm_middleware.lifecycle.config import GenerationSettings, LifecycleConfig
    from clm_middleware.lifecycle.modes import TAGGING_MODES
    from clm_middleware.lifecycle.segmenter import Segmenter
    from clm_middleware.lifecycle.segments import DecidedBy, Decision, Label, MessageRecord, Segment, SegmentId, Status
    from clm_middleware.lifecycle.tagging import TaggingConfig
    from clm_middleware.lifecycle.turn import Reply, TurnStats

__getattr__, __dir__ = lazy_namespace(__name__, globals(), _EXPORTS)

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
