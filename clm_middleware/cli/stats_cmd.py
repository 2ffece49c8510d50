"""``clm stats``: what a store holds: conversations, turns, context, decisions, summaries."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text


@click.command()
@click.option("--db", type=click.Path(path_type=Path, exists=True, dir_okay=False), required=True, help="SQLite store.")
@click.option("--conversation", "conversation_id", default=None, help="Show this conversation turn by turn.")
def stats(db: Path, conversation_id: str | None) -> None:
    """Summarise the conversations in a store, or one conversation turn by turn."""
    from clm_middleware.cli.output import print_whole
    from clm_middleware.store import Store

    store = Store(db, read_only=True)  # a read command never writes, and refuses a foreign file
    console = Console(emoji=False)
    try:
        if conversation_id is not None:
            store.conversation_row(conversation_id)  # a clear error if it is not there
            print_whole(console, _turns_table(store, conversation_id))
            return
        ids = store.conversation_ids()
        if not ids:
            console.print(f"{db}: no conversations", markup=False)
            return
        print_whole(console, _conversations_table(store, ids))
    except sqlite3.Error as error:  # a table missing or a page damaged: name the file, not a traceback
        raise click.ClickException(f"{db}: cannot read ({error})") from None


def _turn_stats(row: dict, conversation_id: str) -> dict:
    """A stored turn's stats, or an error naming the conversation and turn whose stats are damaged."""
    try:
        stats = json.loads(row["stats"])
        [stats[key] for key in _TURN_KEYS]
        return stats
    except (ValueError, KeyError, TypeError) as error:
        raise click.ClickException(
            f"conversation {conversation_id!r}, turn {row.get('turn')}: its stored stats are damaged ({error!r})"
        ) from None


_TURN_KEYS = ("turn", "prompt_tokens", "cached_tokens", "prefill_tokens", "context_tokens", "decisions", "summaries")


def _conversations_table(store, ids: list[str]) -> Table:
    table = Table(title=Text(f"{store.path} · {len(ids)} conversations"), title_justify="left")
    for column in (
        "conversation",
        "model",
        "turns",
        "messages",
        "context tokens",
        "keep/compress/drop",
        "by source",
        "summaries",
    ):
        table.add_column(column, justify="left" if column in ("conversation", "model", "by source") else "right")
    db = store.db
    for cid in ids:
        row = store.conversation_row(cid)
        last = list(db["turns"].rows_where("conversation_id = ?", [cid], order_by="turn desc", limit=1))
        context = _turn_stats(last[0], cid)["context_tokens"] if last else 0
        labels = {
            r["label"]: r["n"]
            for r in db.query("select label, count(*) n from decisions where conversation_id = ? group by label", [cid])
        }
        sources = {
            r["decided_by"]: r["n"]
            for r in db.query(
                "select decided_by, count(*) n from decisions where conversation_id = ? group by decided_by", [cid]
            )
        }
        summaries = db["summaries"].count_where("conversation_id = ? and ok = 1", [cid])
        table.add_row(
            Text(cid),
            Text(row["model"] or ""),
            str(row["turn"]),
            str(db["messages"].count_where("conversation_id = ?", [cid])),
            str(context),
            f"{labels.get('keep', 0)}/{labels.get('compress', 0)}/{labels.get('drop', 0)}",
            ", ".join(f"{k} {v}" for k, v in sorted(sources.items())) or "-",
            str(summaries),
        )
    return table


def _turns_table(store, conversation_id: str) -> Table:
    table = Table(title=Text(conversation_id), title_justify="left")
    for column in (
        "turn",
        "prompt",
        "cached",
        "prefill",
        "context",
        "keep/compress/drop",
        "by",
        "compaction",
        "summaries",
        "by user",
    ):
        table.add_column(column, justify="right" if column not in ("by", "compaction", "by user") else "left")
    by_user = _user_decisions(store, conversation_id)
    for row in store.rows("turns", conversation_id, "turn"):
        stats = _turn_stats(row, conversation_id)
        decisions = stats["decisions"]
        table.add_row(
            str(stats["turn"]),
            str(stats["prompt_tokens"]),
            str(stats["cached_tokens"]),
            str(stats["prefill_tokens"]),
            str(stats["context_tokens"]),
            f"{decisions.get('keep', 0)}/{decisions.get('compress', 0)}/{decisions.get('drop', 0)}",
            stats.get("tagging_mode") or "-",
            Text(stats.get("compaction") or ""),
            str(len(stats["summaries"])),
            by_user.get(stats["turn"], ""),
        )
    return table


def _user_decisions(store, conversation_id: str) -> dict[int, str]:
    """Per turn, the pins and forgets made after it (``Conversation.pin`` / ``forget``,
    clm chat's /pin and /forget, recorded at the turn they follow): "pinned 1, forgotten 2"."""
    from clm_middleware.lifecycle.segments import BY_USER

    counts: dict[int, dict[str, int]] = {}
    for row in store.db.query(
        "select turn, reason, count(*) n from decisions where conversation_id = ? and reason like ? "
        "group by turn, reason",
        [conversation_id, "%" + BY_USER],
    ):
        counts.setdefault(row["turn"], {})[row["reason"].removesuffix(BY_USER)] = row["n"]
    return {turn: ", ".join(f"{what} {n}" for what, n in sorted(kinds.items())) for turn, kinds in counts.items()}
