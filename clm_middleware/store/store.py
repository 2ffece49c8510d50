"""SQLite persistence of conversations: messages, segments with state and provenance,
decisions, summaries and per-turn stats.

Invariants:
- WAL mode; one transaction per turn (``save``), so a process killed mid-turn leaves
  the store at its last complete turn.
- The file is created owner-only (0600) and a directory it creates is 0700: it holds
  users' conversations.
- One ``Store`` may be shared by conversations on several threads; writes are serialised.
- Several processes may share one file: every write transaction starts ``IMMEDIATE``,
  so a second writer waits for the first (up to 30 s) instead of failing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlite_utils import Database
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random

from clm_middleware.errors import ConversationExistsError, StoreError
from clm_middleware.lifecycle.segments import DecidedBy, Label, MessageRecord, Segment, SegmentId, Status
from clm_middleware.private_dirs import make_private_dirs
from clm_middleware.render.chat_format import ROLES
from clm_middleware.store.migrations import MIGRATIONS_TABLE, migrate, unknown_migrations
from clm_middleware.store.records import ConversationChanges, ConversationRecord, StoredConversation

if TYPE_CHECKING:
    from clm_middleware.lifecycle.turn import TurnStats


# A fresh file is in rollback mode: two processes opening it at once may both hold a read
# lock while each asks for the exclusive one WAL mode needs, and SQLite then answers
# "database is locked" at once rather than wait (the busy timeout is not consulted in a
# deadlock); one of them tries again (a two-process test had failed on it, rarely)
OPEN_TRIES = 20


def _locked(error: BaseException) -> bool:
    return isinstance(error, sqlite3.OperationalError) and "locked" in str(error)


class Store:
    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        """Open (creating, migrating) the store at ``path``; ``read_only`` opens an existing
        store of ours without writing a byte, and refuses any other file."""
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory, not a store file")
        if read_only:
            self._open_read_only()
            return
        try:
            _create_private(self.path)
        except OSError as error:  # a read-only folder, a path through a file, a full disk
            raise StoreError(f"{self.path}: cannot create the store ({error.strerror or error})") from None
        try:
            connection = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
            self.db = Database(connection)
            self._check_ours(writing=True)
            for attempt in Retrying(
                retry=retry_if_exception(_locked),
                stop=stop_after_attempt(OPEN_TRIES),
                wait=wait_random(0.02, 0.2),
                reraise=True,
            ):
                with attempt:
                    self.db.enable_wal()
            self._lock = threading.RLock()
            with self._writing():
                migrate(self.db)
        except sqlite3.DatabaseError as error:
            raise StoreError(f"{self.path}: not a usable SQLite store ({error})") from None

    def _check_ours(self, *, writing: bool) -> None:
        """Refuse, before any write, a database of another program (tables of its own and
        none of ours: writing would add our tables to it) and a store written by a newer
        version (a schema this one does not know)."""
        tables = self.db.table_names()
        if not writing and not (MIGRATIONS_TABLE in tables and "conversations" in tables):
            self.db.close()
            raise StoreError(f"{self.path}: not a clm-middleware store (no conversations table)")
        if tables and MIGRATIONS_TABLE not in tables:
            self.db.close()
            shown = ", ".join(sorted(tables)[:5])
            raise StoreError(
                f"{self.path}: not a clm-middleware store (it holds other tables: {shown}); "
                "refusing to write into it: give a new file or an existing store"
            )
        if newer := unknown_migrations(self.db):
            self.db.close()
            raise StoreError(
                f"{self.path}: written by a newer clm-middleware (schema changes {', '.join(newer)} are unknown "
                "here); upgrade clm-middleware to use it"
            )

    def close(self) -> None:
        self.db.close()

    def _open_read_only(self) -> None:
        """Open without writing. A store in write-ahead-log mode needs its ``-shm`` file
        even to be read, which SQLite cannot create in a read-only directory (an archived
        store, another user's): there it is read as an immutable file, unless a log of
        writes not yet merged lies beside it (reading past it would show an older state)."""
        if not self.path.is_file():
            raise StoreError(f"{self.path}: no such store")
        try:
            self._connect_read_only("mode=ro")
        except sqlite3.OperationalError as error:
            if os.access(self.path.parent, os.W_OK):
                raise StoreError(f"{self.path}: not a usable SQLite store ({error})") from None
            log = self.path.with_name(self.path.name + "-wal")
            if log.is_file() and log.stat().st_size:
                raise StoreError(
                    f"{self.path}: its directory is read-only and it has writes not merged yet ({log.name}); "
                    "copy the store and its -wal file to a writable directory to read it"
                ) from None
            try:
                self._connect_read_only("immutable=1")
            except sqlite3.DatabaseError as again:
                raise StoreError(f"{self.path}: not a usable SQLite store ({again})") from None
        except sqlite3.DatabaseError as error:
            raise StoreError(f"{self.path}: not a usable SQLite store ({error})") from None
        self._lock = threading.RLock()

    def _connect_read_only(self, mode: str) -> None:
        connection = sqlite3.connect(f"file:{self.path}?{mode}", uri=True, check_same_thread=False, timeout=30)
        self.db = Database(connection)
        try:
            self._check_ours(writing=False)
        except sqlite3.DatabaseError:
            connection.close()
            raise

    # --------------------------------------------------------------- writes

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction that takes SQLite's write lock at its start
        (``BEGIN IMMEDIATE``). A deferred transaction that reads first and writes later
        fails at once with "database is locked" when another process wrote in between
        (WAL cannot upgrade a stale snapshot, and the busy timeout is not consulted);
        an immediate one waits up to the connection's busy timeout for the other
        writer instead. sqlite-utils' own ``atomic()`` blocks nest inside as savepoints."""
        with self._lock, self._named_errors("cannot write"):
            self.db.conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                if self.db.conn.in_transaction:
                    self.db.conn.rollback()
                raise
            self.db.conn.commit()

    @contextlib.contextmanager
    def _named_errors(self, doing: str) -> Iterator[None]:
        """SQLite's errors (a lock held past the busy timeout, a damaged file, a full disk)
        as a ``StoreError`` naming the file; a write that fails commits nothing."""
        try:
            yield
        except sqlite3.Error as error:
            raise StoreError(f"{self.path}: {doing} ({error})") from error

    def register(self, record: ConversationRecord) -> None:
        """Create a new conversation's row. An id the store holds already is refused: the
        new conversation's saves would overwrite the stored one's messages by index and
        leave a mix of the two (``Conversation.load`` continues a stored one instead)."""
        with self._writing():
            if self.db["conversations"].count_where("id = ?", [record.id]):
                raise ConversationExistsError(
                    f"{self.path}: conversation {record.id!r} is stored already; continue it with "
                    f"Conversation.load(store, {record.id!r}), or give the new one another conversation_id"
                )
            self.db["conversations"].insert(_conversation_row(record, created=True))

    def unregister(self, conversation_id: str) -> None:
        """Remove a conversation that never saved a turn (one whose first call failed): its
        row and what was saved with it (the system prompt it was created with); one with a
        turn stored is left as it is."""
        with self._writing():
            turns = self.db["turns"]
            if turns.exists() and turns.count_where("conversation_id = ?", [conversation_id]):
                return
            for table in ("messages", "segments", "decisions", "summaries"):
                if self.db[table].exists():
                    self.db[table].delete_where("conversation_id = ?", [conversation_id])
            self.db["conversations"].delete_where("id = ?", [conversation_id])

    def save(
        self,
        record: ConversationRecord,
        changes: ConversationChanges,
        turns: Sequence[TurnStats] = (),
        *,
        expected_turn: int | None = None,
    ) -> None:
        """The conversation's row, what changed since the last save and the stats of the
        ``turns`` run since (one; or all a conversation ran before it was attached to the
        store), in one transaction. ``expected_turn``: the turn the writer last saw in the store; a row
        that says another (a second writer continued the conversation: two loads of one
        id) is a ``StoreError`` and nothing is written, rather than one writer's messages
        overwriting the other's by index."""
        with self._writing():
            if expected_turn is not None:
                stored = list(self.db["conversations"].rows_where("id = ?", [record.id], select="turn"))
                if stored and stored[0]["turn"] != expected_turn:
                    raise StoreError(
                        f"{self.path}: conversation {record.id!r} changed in the store since this object read "
                        f"or wrote it (turn {stored[0]['turn']} there, {expected_turn} when last seen): another "
                        "writer continues it; nothing was saved",
                        hint=(
                            f"load it again to continue what is stored: Conversation.load(store, {record.id!r}), "
                            f"or clm chat --db {self.path} --session {record.id}"
                        ),
                    )
            self.db["conversations"].upsert(_conversation_row(record, created=False), pk="id")
            if changes.cut_at is not None and self.db["messages"].exists():
                self.db["messages"].delete_where("conversation_id = ? and idx >= ?", [record.id, changes.cut_at])
            if changes.cut_segments and self.db["segments"].exists():
                for segment in changes.cut_segments:
                    self.db["segments"].delete_where("conversation_id = ? and id = ?", [record.id, segment])
            if changes.messages:
                self.db["messages"].upsert_all(
                    [_message_row(record.id, m) for m in changes.messages], pk=("conversation_id", "idx")
                )
            if changes.segments:
                self.db["segments"].upsert_all(
                    [_segment_row(record.id, s) for s in changes.segments], pk=("conversation_id", "id")
                )
            if changes.decisions:
                self.db["decisions"].insert_all(
                    [{"conversation_id": record.id, **d.as_dict()} for d in changes.decisions]
                )
            for turn in turns:
                self.db["summaries"].insert_all(
                    [{"conversation_id": record.id, "turn": turn.turn, **s} for s in turn.summaries]
                )
                self.db["turns"].upsert(
                    {"conversation_id": record.id, "turn": turn.turn, "stats": json.dumps(turn.as_dict())},
                    pk=("conversation_id", "turn"),
                )

    def load(self, conversation_id: str) -> StoredConversation:
        """Every message, segment and turn's stats of one conversation; a ``StoreError`` if it is not there."""
        row = self.conversation_row(conversation_id)
        with self._named_errors("cannot read"):
            has_turns = self.db["turns"].exists()
            lost = [table for table in ("messages", "segments") if not self.db[table].exists()]
        if lost:
            raise StoreError(f"{self.path}: the {lost[0]} table is gone (damaged); conversations cannot be loaded")
        rows = {table: self.rows(table, conversation_id, "idx") for table in ("messages", "segments")}
        turn_rows = self.rows("turns", conversation_id, "turn") if has_turns else []
        try:  # a row another program or a partial write left unreadable: never half-loaded
            record = ConversationRecord(
                id=row["id"],
                model=row["model"],
                settings=_typed(json.loads(row["settings"] or "{}"), dict, "the settings"),
                turn=_count(row["turn"], "the turn counter"),
                next_index=_count(row["next_index"], "the next segment number"),
                fold=_count(row.get("fold") or 0, "the digest fold"),
                protocol_context=bool(row["protocol_context"]),
                parse_history=_typed(json.loads(row["parse_history"] or "[]"), list, "the parse history"),
            )
            messages = [_message(m) for m in rows["messages"]]
            segments = [_segment(s) for s in rows["segments"]]
            turns = [_turn_stats(t) for t in turn_rows]
        except (ValueError, TypeError, KeyError) as error:  # JSONDecodeError is a ValueError
            raise StoreError(
                f"{self.path}: conversation {conversation_id!r} has a damaged row ({type(error).__name__}: {error})"
            ) from error
        if [m.index for m in messages] != list(range(len(messages))):
            raise StoreError(f"{self.path}: conversation {conversation_id!r} has gaps in its messages (damaged)")
        if (record.turn or segments) and not messages:  # every turn answered a message: its rows are gone
            raise StoreError(f"{self.path}: conversation {conversation_id!r} has lost its messages (damaged)")
        if any(s.message_index >= len(messages) for s in segments):
            raise StoreError(
                f"{self.path}: conversation {conversation_id!r} has segments of messages it lacks (damaged)"
            )
        missing = {s for m in messages for s in m.segment_ids} - {s.id for s in segments}
        if missing:
            raise StoreError(
                f"{self.path}: conversation {conversation_id!r} lacks segments its messages list "
                f"({', '.join(sorted(missing)[:3])}; damaged)"
            )
        return StoredConversation(record, messages, segments, turns)

    # ---------------------------------------------------------------- reads

    def conversation_ids(self) -> list[str]:
        with self._lock, self._named_errors("cannot read"):
            return [row["id"] for row in self.db["conversations"].rows_where(order_by="created_at")]

    def conversation_row(self, conversation_id: str) -> dict[str, Any]:
        with self._lock, self._named_errors("cannot read"):
            rows = list(self.db["conversations"].rows_where("id = ?", [conversation_id]))
        if not rows:
            raise StoreError(
                f"{self.path}: no conversation {conversation_id!r}",
                hint="`clm stats --db` lists them",
            )
        return rows[0]

    def rows(self, table: str, conversation_id: str, order_by: str) -> list[dict[str, Any]]:
        with self._lock, self._named_errors("cannot read"):
            return list(self.db[table].rows_where("conversation_id = ?", [conversation_id], order_by=order_by))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _conversation_row(record: ConversationRecord, *, created: bool) -> dict[str, Any]:
    row = {
        "id": record.id,
        "updated_at": _now(),
        "model": record.model,
        "settings": json.dumps(record.settings),
        "turn": record.turn,
        "next_index": record.next_index,
        "fold": record.fold,
        "protocol_context": int(record.protocol_context),
        "parse_history": json.dumps(record.parse_history),
    }
    if created:
        row["created_at"] = row["updated_at"]
    return row


def _message_row(conversation_id: str, message: MessageRecord) -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        "idx": message.index,
        "role": message.role,
        "content": message.content,
        "turn": message.turn,
        "raw_output": message.raw_output,
        "segment_ids": json.dumps(message.segment_ids),
    }


def _segment_row(conversation_id: str, segment: Segment) -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        "id": segment.id,
        "idx": segment.index,
        "message_idx": segment.message_index,
        "role": segment.role,
        "kind": segment.kind,
        "text": segment.text,
        "token_ids": json.dumps(segment.token_ids),
        "separator": segment.separator,
        "turn": segment.turn,
        "pinned": int(segment.pinned),
        "status": segment.status.value,
        "label": segment.label.value,
        "decided_by": segment.decided_by.value if segment.decided_by else None,
        "summary": segment.summary,
        "summary_ids": json.dumps(segment.summary_ids) if segment.summary_ids is not None else None,
        "summary_method": segment.summary_method,
        "surprisal": json.dumps(segment.surprisal) if segment.surprisal is not None else None,
        "attention": segment.attention,
        "removed_round": segment.removed_round,
    }


_KINDS = {str: "text", int: "a whole number", dict: "an object", list: "a list"}


def _typed(value: Any, kind: Any, what: str) -> Any:
    """``value`` if it is a ``kind`` (a bool is no number here), else a ``TypeError`` naming ``what``."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{what} is {type(value).__name__}, not {_KINDS.get(kind, 'a number')}")
    return value


def _count(value: Any, what: str) -> int:
    if _typed(value, int, what) < 0:
        raise ValueError(f"{what} is negative")
    return value


def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise TypeError(f"{what} are not a list of token ids")
    return value


def _text_or_none(value: Any, what: str) -> str | None:
    return None if value is None else _typed(value, str, what)


def _turn_stats(row: dict[str, Any]) -> dict[str, Any]:
    stats = _typed(json.loads(row["stats"]), dict, f"turn {row['turn']}'s stats")
    _count(stats.get("turn"), f"turn {row['turn']}'s number")
    return stats


def _message(row: dict[str, Any]) -> MessageRecord:
    if row["role"] not in ROLES:
        raise ValueError(f"message {row['idx']} has the unknown role {row['role']!r}")
    where = f"message {row['idx']}"
    segment_ids = _typed(json.loads(row["segment_ids"] or "[]"), list, f"{where}'s segment ids")
    return MessageRecord(
        index=_count(row["idx"], "a message's index"),
        role=row["role"],
        content=_typed(row["content"], str, f"{where}'s content"),
        turn=_count(row["turn"], f"{where}'s turn"),
        segment_ids=[SegmentId(_typed(s, str, f"{where}'s segment id")) for s in segment_ids],
        raw_output=_text_or_none(row["raw_output"], f"{where}'s raw output"),
    )


def _segment(row: dict[str, Any]) -> Segment:
    if row["role"] not in ROLES:
        raise ValueError(f"segment {row['id']} has the unknown role {row['role']!r}")
    where = f"segment {row['id']}"
    summary_ids = json.loads(row["summary_ids"]) if row["summary_ids"] else None
    surprisal = json.loads(row["surprisal"]) if row["surprisal"] else None
    if surprisal is not None and not (
        isinstance(surprisal, list)
        and all(x is None or (isinstance(x, int | float) and not isinstance(x, bool)) for x in surprisal)
    ):
        raise TypeError(f"{where}'s surprisal is not a list of numbers (or nulls where a token was not scored)")
    return Segment(
        id=SegmentId(_typed(row["id"], str, "a segment's id")),
        index=_count(row["idx"], f"{where}'s index"),
        message_index=_count(row["message_idx"], f"{where}'s message"),
        role=row["role"],
        kind=_typed(row["kind"], str, f"{where}'s kind"),
        text=_typed(row["text"], str, f"{where}'s text"),
        token_ids=_ids(json.loads(row["token_ids"]), f"{where}'s token ids"),
        separator=_text_or_none(row["separator"], f"{where}'s separator") or "",
        turn=_count(row["turn"], f"{where}'s turn"),
        pinned=bool(row["pinned"]),
        status=Status(row["status"]),
        label=Label(row["label"]),
        decided_by=DecidedBy(row["decided_by"]) if row["decided_by"] else None,
        summary=_text_or_none(row["summary"], f"{where}'s summary"),
        summary_ids=None if summary_ids is None else _ids(summary_ids, f"{where}'s summary ids"),
        summary_method=_text_or_none(row["summary_method"], f"{where}'s summary method"),
        surprisal=surprisal,
        attention=float(_typed(row["attention"] or 0.0, int | float, f"{where}'s attention")),
        removed_round=None
        if row["removed_round"] is None
        else _count(row["removed_round"], f"{where}'s removal round"),
    )


def _create_private(path: Path) -> None:
    if not path.parent.exists():
        make_private_dirs(path.parent)
    if not path.exists():
        descriptor = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(descriptor)
