"""Schema changes as small functions applied in order, each recorded once (simonw/llm style).

Add a migration by appending a function decorated with ``@migration``; never edit
one that has shipped. ``migrate(db)`` brings any older store up to date.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from sqlite_utils import Database

MIGRATIONS_TABLE = "_clm_migrations"
MIGRATIONS: list[Callable[[Database], None]] = []


def migration(function: Callable[[Database], None]) -> Callable[[Database], None]:
    MIGRATIONS.append(function)
    return function


def unknown_migrations(db: Database) -> list[str]:
    """Migrations the store records that this version does not have: a store written by a
    newer clm-middleware, whose schema this one cannot read or write safely."""
    if not db[MIGRATIONS_TABLE].exists():
        return []
    known = {function.__name__ for function in MIGRATIONS}
    return sorted(row["name"] for row in db[MIGRATIONS_TABLE].rows if row["name"] not in known)


def migrate(db: Database) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now."""
    if not db[MIGRATIONS_TABLE].exists():
        db[MIGRATIONS_TABLE].create({"name": str, "applied_at": str}, pk="name")
    done = {row["name"] for row in db[MIGRATIONS_TABLE].rows}
    applied = []
    for function in MIGRATIONS:
        if function.__name__ in done:
            continue
        with db.atomic():
            function(db)
            db[MIGRATIONS_TABLE].insert(
                {
                    "name": function.__name__,
                    "applied_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                }
            )
        applied.append(function.__name__)
    return applied


@migration
def m001_initial(db: Database) -> None:
    db["conversations"].create(
        {
            "id": str,
            "created_at": str,
            "updated_at": str,
            "model": str,
            "settings": str,  # JSON
            "turn": int,
            "next_index": int,
            "protocol_context": int,
            "parse_history": str,  # JSON list of booleans
        },
        pk="id",
    )
    db["messages"].create(
        {
            "conversation_id": str,
            "idx": int,
            "role": str,
            "content": str,
            "turn": int,
            "raw_output": str,
            "segment_ids": str,  # JSON
        },
        pk=("conversation_id", "idx"),
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["segments"].create(
        {
            "conversation_id": str,
            "id": str,
            "idx": int,
            "message_idx": int,
            "role": str,
            "kind": str,
            "text": str,
            "token_ids": str,  # JSON: the exact ids, so a reload renders the same prompt
            "separator": str,
            "turn": int,
            "pinned": int,
            "status": str,
            "label": str,
            "decided_by": str,
            "summary": str,
            "summary_ids": str,
            "summary_method": str,
            "surprisal": str,
            "attention": float,
            "removed_round": int,
        },
        pk=("conversation_id", "id"),
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["decisions"].create(
        {
            "id": int,
            "conversation_id": str,
            "turn": int,
            "segment_id": str,
            "label": str,
            "decided_by": str,
            "reason": str,
            "confidence": float,
        },
        pk="id",
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["summaries"].create(
        {
            "id": int,
            "conversation_id": str,
            "turn": int,
            "segment_id": str,
            "ok": int,
            "method": str,
            "original_tokens": int,
            "summary_tokens": int,
            "summary": str,
            "error": str,
            "rejected": str,
        },
        pk="id",
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["turns"].create(
        {"conversation_id": str, "turn": int, "stats": str},
        pk=("conversation_id", "turn"),
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["decisions"].create_index(["conversation_id", "turn"])
    db["summaries"].create_index(["conversation_id", "segment_id"])


@migration
def m002_digest_fold(db: Database) -> None:
    """Conversations remember how many leading messages are folded into the digest."""
    db["conversations"].add_column("fold", int, not_null_default=0)
