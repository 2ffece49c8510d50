"""Render ``docs/store.md`` from the store's own schema, so the page cannot drift.

``python -m clm_middleware.store.docs docs/store.md`` rewrites it; a test fails when
the committed page differs from what this renders.
"""

from __future__ import annotations

from sqlite_utils import Database

from clm_middleware.store.migrations import MIGRATIONS, MIGRATIONS_TABLE, migrate

INTRO = """# The conversation store (SQLite)

`Conversation(..., store="chats.db")`, `clm replay --mode clm --db`, `clm chat --db`.
WAL mode; one transaction per turn (what was added before a turn, a seeded history or a
fork's copy, is saved with it, or by `close()` if no turn comes: closed before its first
reply, a conversation had loaded back empty; a system prompt given to the constructor is
saved with the conversation's row at once: a process killed in the first turn had left a
row without it, which a resume continued with no system prompt; a conversation whose
first call failed leaves neither, `abandon`); the file is
created owner-only (0600). Schema
changes are ordered migrations recorded in `{table}`
(`clm_middleware/store/migrations.py`): {names}.

A stored conversation is continued with `Conversation.load(store, id)`, never
overwritten: a new `Conversation` given an id the store holds raises
`ConversationExistsError`. `ChatCLM` and `clm serve`, whose callers re-send the whole
history, then start the conversation under a suffixed id (`s1~1a2b3c4d`); `clm replay`
suffixes `#2`, `#3`. Segments are stored as token ids, so a conversation loads only onto
an engine whose tokenizer reads them back as their text: another model's engine is a
`ConfigError` naming the model that stored it (a model sharing the tokenizer loads it).
Settings given to `load` apply from then on (a `tagging` given decides whether the
protocol is shown, as for a new conversation; a `budget` must hold the stored system
messages, else `ContextBudgetError`); a `system_prompt` is a `ConfigError` (the stored
one stands: `add("system", ...)` adds another).
A file that is another program's database (tables of its own, none of ours) or a store
written by a newer version (a migration this one does not know) is refused before a
byte is written (`StoreError` naming the file); a fork that `ChatCLM` or `clm serve`
makes has its first conversation's id plus one suffix, however many times it forks
(`Conversation.fork` takes an id, else a fresh one).

A save that fails (another process holds the write lock past the 30 s busy timeout, a
full disk, a damaged file) is a `StoreError` naming the file and writes nothing; the
turn stays in memory and the next save writes it with its own, so the store never has a
gap. Two objects continuing one stored conversation (two `Conversation.load`s of one
id, two `clm chat --session` windows) cannot overwrite each other: a save whose row
says another turn than the writer last read or wrote is refused (`StoreError`: load it
again). A store whose pages are damaged is a `StoreError` naming the file on load, and so is a
row that does not read back (a value that is not its JSON or not of its type, a segment
a message lists that is gone, messages gone from a conversation with turns or segments,
a token id outside the vocabulary): a conversation is loaded whole or not at all. A read
(`clm stats`, `Conversation.load`) never writes the store (a path given to `load` is checked
read-only first, then opened for the saves to come where the file and its directory
are writable; in a writable directory SQLite leaves its empty `-wal` and its `-shm`
index beside the file, as it does for any reader of a WAL database), and reads a store in a read-only directory too (an
archive, another user's; SQLite cannot make the `-shm` file there, so the file is read
as immutable), unless a `-wal` file of writes not merged yet lies beside it: copy both
to a writable directory then. A conversation attached to a store after its first turns
(`attach_store`, `clm chat`'s `/save`) writes every turn's stats, not only the ones after;
a fork is stored with the turns of the history it shares. `clm stats --conversation ID`
shows a row per turn, its `by user` column the pins and forgets made after that turn
(decisions whose reason ends "by user", recorded at the turn they follow).

Generated from the schema by `python -m clm_middleware.store.docs docs/store.md`;
do not edit by hand.
"""

NOTES = {
    "conversations": "One row per conversation: settings (JSON) to reload it (the constructor's arguments, and what a config or generation object of one's own set beyond them), the turn counter, the next segment number, the digest fold, whether the protocol context is on, and the recent free-form parse results.",
    "messages": "Everything said, complete (`content`), whatever the context keeps of it; `raw_output` is the model's full output with any lifecycle block; `segment_ids` (JSON) in order.",
    "segments": "The units the lifecycle decides about: `token_ids` (JSON) so a reload renders the same prompt, `status` (active, compressed, dropped), the latest `label` and who decided it, the `summary` that replaces a compressed segment (the original `text` always stays), self-information (`surprisal`, JSON) and decayed attention density.",
    "decisions": "Every label decided, per turn and segment, with `decided_by` (model, constrained, signals, rules) and the reason.",
    "summaries": "Every compression tried: method (extractive, abstractive, distinctive), token counts, the summary, and why one failed or was rejected.",
    "turns": "Per-turn stats (JSON): the same fields as a replay report's lifecycle turn.",
}


def render_store_reference() -> str:
    db = Database(memory=True)
    migrate(db)
    lines = [INTRO.format(table=MIGRATIONS_TABLE, names=", ".join(f"`{m.__name__}`" for m in MIGRATIONS))]
    for name in sorted(n for n in db.table_names() if not n.startswith("_")):
        table = db[name]
        lines += [f"## `{name}`", "", NOTES.get(name, ""), "", "| column | type | key |", "| --- | --- | --- |"]
        keys = set(table.pks)
        lines += [f"| `{c.name}` | {c.type} | {'primary' if c.name in keys else ''} |" for c in table.columns]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from clm_middleware.reference_docs import write_reference

    write_reference(render_store_reference, "docs/store.md", "store schema reference")
