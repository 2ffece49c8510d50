"""Persistence: conversations in SQLite, and loading them back."""

from __future__ import annotations

import json
from collections import deque
from typing import TYPE_CHECKING, Any

from clm_middleware.lifecycle.segments import (
    DecidedBy,
    Label,
    MessageRecord,
    Segment,
    SegmentId,
    Status,
)
from clm_middleware.store.migrations import MIGRATIONS, migrate
from clm_middleware.store.store import Store, StoreError

if TYPE_CHECKING:
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine

__all__ = ["MIGRATIONS", "Store", "StoreError", "load_conversation", "migrate"]


def load_conversation(
    cls: type[Conversation],
    store: Store | str,
    conversation_id: str,
    engine: Engine | None,
    **overrides: Any,
) -> Conversation:
    """Rebuild a conversation from its rows; the next prompt renders exactly as before."""
    store = store if isinstance(store, Store) else Store(store)
    row = store.conversation_row(conversation_id)
    settings = json.loads(row["settings"] or "{}")
    settings.update(overrides)
    conversation = cls(engine, store=store, conversation_id=conversation_id, **settings)
    conversation.messages = [
        MessageRecord(
            index=m["idx"],
            role=m["role"],
            content=m["content"],
            turn=m["turn"],
            segment_ids=[SegmentId(s) for s in json.loads(m["segment_ids"] or "[]")],
            raw_output=m["raw_output"],
        )
        for m in store.rows("messages", conversation_id, "idx")
    ]
    conversation._segments = {SegmentId(s["id"]): _segment(s) for s in store.rows("segments", conversation_id, "idx")}
    conversation.turn = row["turn"]
    conversation._next_index = row["next_index"]
    conversation.fold = row.get("fold") or 0
    conversation.protocol_context = bool(row["protocol_context"])
    conversation.renderer = conversation._make_renderer()
    history = json.loads(row["parse_history"] or "[]")
    conversation.tagger.parse_history = deque(history, maxlen=conversation.tagger.parse_history.maxlen)
    conversation._unsaved_messages.clear()
    conversation._dirty.clear()
    return conversation


def _segment(row: dict[str, Any]) -> Segment:
    return Segment(
        id=SegmentId(row["id"]),
        index=row["idx"],
        message_index=row["message_idx"],
        role=row["role"],
        kind=row["kind"],
        text=row["text"],
        token_ids=json.loads(row["token_ids"]),
        separator=row["separator"] or "",
        turn=row["turn"],
        pinned=bool(row["pinned"]),
        status=Status(row["status"]),
        label=Label(row["label"]),
        decided_by=DecidedBy(row["decided_by"]) if row["decided_by"] else None,
        summary=row["summary"],
        summary_ids=json.loads(row["summary_ids"]) if row["summary_ids"] else None,
        summary_method=row["summary_method"],
        surprisal=json.loads(row["surprisal"]) if row["surprisal"] else None,
        attention=row["attention"] or 0.0,
        removed_round=row["removed_round"],
    )
