"""SQLite persistence: a reloaded conversation renders the same context; migrations apply once."""

import dataclasses
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys

import pytest
from sqlite_utils import Database

from clm_middleware.conversation import Conversation
from clm_middleware.errors import StoreError
from clm_middleware.store import MIGRATIONS, Store, migrate
from clm_middleware.store.migrations import MIGRATIONS_TABLE


def test_a_reloaded_conversation_renders_the_same_context_keeps_its_turn_stats_and_continues(
    converse, engine, tmp_path
):
    path = tmp_path / "chats.db"
    conversation = converse(store=path, system_prompt="Be brief.", budget=400, conversation_id="trip")
    for text in (
        "My booking code is QX7-4821.",
        "ok thanks",
        "Tell me about rivers and valleys please.",
        "cool",
    ):
        conversation.send(text)
    conversation.forget(conversation.segments[2].id)
    expected_context = conversation.context
    expected_prompt = conversation.render_prompt(None).token_ids
    expected_statuses = [(s.id, s.status, s.label, s.turn) for s in conversation.segments]
    expected_stats = conversation.stats()
    conversation.close()

    loaded = Conversation.load(path, "trip", engine)
    assert loaded.context == expected_context
    assert loaded.render_prompt(None).token_ids == expected_prompt
    assert [(s.id, s.status, s.label, s.turn) for s in loaded.segments] == expected_statuses
    assert [m.content for m in loaded.history] == [m.content for m in conversation.history]
    assert loaded.config.budget == 400 and loaded.turn == 4
    for total in ("turns", "prompt_tokens", "cached_tokens", "prefill_tokens"):  # totals over every turn so far
        assert loaded.stats()[total] == expected_stats[total]
    assert [t.turn for t in loaded.turn_log] == [1, 2, 3, 4]
    reply = loaded.send("What was my booking code?")
    assert reply.turn == 5 and reply.segment_id == f"seg_{conversation._next_index + 1}"
    assert loaded.stats()["turns"] == 5 and loaded.turn_log[-1] == reply.stats
    loaded.close()


def test_a_tightened_digest_line_is_saved_so_a_reload_renders_the_same_digest(tiny_model, tiny_tok, tmp_path):
    """Compaction's pass 3 shortens condensed lines to their facts; the store must hold
    the shortened text, or a reload renders the longer one (a different prompt)."""
    from clm_middleware.engine import Engine
    from clm_middleware.lifecycle.compressor import TIGHTENED
    from clm_middleware.models import ScriptedReplies

    script = ScriptedReplies()
    engine = Engine(tiny_model, tiny_tok, logits_processors=[script])
    path = tmp_path / "tight.db"
    conversation = Conversation(
        engine, system_prompt="You book trips.", budget=256, tagging="signals", store=path, conversation_id="c1"
    )
    messages = [
        "My booking code is QX7-4821 and I fly on April 22.",
        "I want a hotel near Alfama with a view of the river, under 120 euros.",
        "ok thanks",
        "Also my colleague Dr. Okafor joins on April 24.",
    ]
    tightened = []
    for number, text in enumerate(messages):
        words = tiny_tok.encode(f"Reply {number}: noted, I will remember that.", add_special_tokens=False)
        script.add([*words, tiny_tok.eos_token_id])
        reply = conversation.send(text)
        tightened += [s for s in reply.stats.summaries if s["method"] == TIGHTENED]
    assert tightened, "the scenario must tighten a digest line"
    expected = conversation.render_prompt(None).token_ids
    summaries = {s.id: s.summary for s in conversation.segments if s.summary}
    conversation.close()
    loaded = Conversation.load(path, "c1", engine)
    assert {s.id: s.summary for s in loaded.segments if s.summary} == summaries
    assert loaded.render_prompt(None).token_ids == expected
    loaded.close()


def test_every_turn_is_saved_with_decisions_and_stats(converse, tmp_path):
    store = Store(tmp_path / "s.db")
    conversation = converse(store=store, conversation_id="c1")
    conversation.send("My order is 42.")
    conversation.send("ok thanks")
    db = store.db
    assert db["messages"].count_where("conversation_id = 'c1'") == 4
    assert db["turns"].count_where("conversation_id = 'c1'") == 2
    assert db["decisions"].count_where("conversation_id = 'c1'") >= 2
    turn_two = json.loads(next(db["turns"].rows_where("turn = 2"))["stats"])
    assert turn_two["turn"] == 2 and "decisions" in turn_two
    segment_row = next(db["segments"].rows_where("conversation_id = 'c1' and id = 'seg_0'"))
    assert json.loads(segment_row["token_ids"]) == conversation.segments[0].token_ids
    conversation.close()


def test_migrations_apply_once_from_a_blank_database(tmp_path):
    db = Database(tmp_path / "blank.db")
    assert migrate(db) == [m.__name__ for m in MIGRATIONS]
    assert migrate(db) == []
    assert {"conversations", "messages", "segments", "decisions", "summaries", "turns"} <= set(db.table_names())
    assert db[MIGRATIONS_TABLE].count == len(MIGRATIONS)


def test_store_file_is_owner_only_and_in_wal_mode(tmp_path):
    path = tmp_path / "private" / "chats.db"
    store = Store(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert store.db.journal_mode == "wal"


def test_a_file_that_is_not_sqlite_is_a_clear_error(tmp_path):
    import pytest

    from clm_middleware.store import StoreError

    path = tmp_path / "notes.db"
    path.write_text("hello, not a database " * 100)
    with pytest.raises(StoreError, match="not a usable SQLite store"):
        Store(path)


def test_another_programs_database_is_refused_and_left_as_it_was(tmp_path):
    from clm_middleware.store import StoreError

    path = tmp_path / "app.sqlite"
    Database(path)["users"].insert({"id": 1})
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"app\.sqlite: not a clm-middleware store \(it holds other tables: users\)"):
        Store(path)
    with pytest.raises(StoreError, match="not a clm-middleware store"):
        Store(path, read_only=True)
    assert path.read_bytes() == before and not (tmp_path / "app.sqlite-wal").exists()


def test_a_store_written_by_a_newer_version_is_refused_before_any_write(tmp_path):
    from clm_middleware.store import StoreError

    path = tmp_path / "newer.sqlite"
    Store(path).close()
    Database(path)[MIGRATIONS_TABLE].insert({"name": "m999_from_the_future", "applied_at": "2027-01-01"})
    for read_only in (False, True):
        with pytest.raises(
            StoreError, match=r"written by a newer clm-middleware \(schema changes m999_from_the_future"
        ):
            Store(path, read_only=read_only)


def test_loading_from_a_mistyped_path_creates_nothing(engine, tmp_path):
    from clm_middleware.store import StoreError

    missing = tmp_path / "no_such_folder" / "x.sqlite"
    with pytest.raises(StoreError, match="no such store"):
        Conversation.load(missing, "nope", engine)
    assert not missing.parent.exists()


def test_a_store_from_an_older_schema_is_migrated_and_still_loads(converse, engine, tmp_path):
    from clm_middleware.store.migrations import m001_initial

    path = tmp_path / "old.db"
    old = Database(path)
    old[MIGRATIONS_TABLE].create({"name": str, "applied_at": str}, pk="name")
    m001_initial(old)
    old[MIGRATIONS_TABLE].insert({"name": "m001_initial", "applied_at": "2026-01-01"})
    old["conversations"].insert(
        {
            "id": "legacy",
            "created_at": "x",
            "updated_at": "x",
            "model": "tiny",
            "settings": "{}",
            "turn": 0,
            "next_index": 0,
            "protocol_context": 0,
            "parse_history": "[]",
        }
    )
    old.close()
    store = Store(path)
    assert "fold" in store.db["conversations"].columns_dict
    loaded = Conversation.load(store, "legacy", engine, tagging="signals")
    assert loaded.fold == 0 and loaded.turn == 0
    assert loaded.send("hello").turn == 1


def test_three_processes_writing_one_store_all_finish(tmp_path):
    """Three `clm replay --db same.db` runs at once: a second writer waits, none crashes."""
    db = tmp_path / "same.db"
    runs = []
    for index in range(3):
        transcript = tmp_path / f"chat{index}.jsonl"
        lines = []
        for turn in range(30):
            lines.append({"role": "user", "content": f"conversation {index}, message {turn}: note code {turn}00-ZX."})
            lines.append({"role": "assistant", "content": f"Noted {turn}."})
        transcript.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        command = [sys.executable, "-m", "clm_middleware.cli.main", "replay", str(transcript), "--model", "tiny"]
        command += ["--mode", "clm", "--teacher-force", "--tagging", "signals", "--db", str(db), "--quiet"]
        runs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    failed = [output[-2000:] for run, output in zip(runs, outputs, strict=True) if run.returncode]
    assert not failed, failed  # the end of a failed run's output names its error
    store = Store(db)
    counts = [row["n"] for row in store.db.query("select count(*) as n from messages group by conversation_id")]
    assert sorted(counts) == [60, 60, 60]


def test_a_fresh_store_whose_switch_to_wal_finds_it_locked_tries_again(tmp_path, monkeypatch):
    """Two processes opening one new file can deadlock on the switch to WAL mode, and
    SQLite answers "database is locked" at once (no busy wait): a clean-clone run of the
    two-process test below failed on it. The opening tries again, a bounded number of times."""
    real, calls = Database.enable_wal, []

    def locked_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        return real(self)

    monkeypatch.setattr(Database, "enable_wal", locked_once)
    store = Store(tmp_path / "fresh.db")
    assert len(calls) == 2 and store.db.execute("pragma journal_mode").fetchone()[0] == "wal"
    store.close()

    def always_locked(self):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(Database, "enable_wal", always_locked)
    with pytest.raises(StoreError, match="database is locked"):  # still locked: named, not a hang
        Store(tmp_path / "other.db")


def test_two_processes_replaying_one_file_into_one_store_each_take_free_ids(tmp_path):
    """Both look for a free id (``conv0``, ``conv0#2``...) before either registers it: the
    one that loses the race takes the next free id instead of failing its turn."""
    db, transcript = tmp_path / "same.db", tmp_path / "many.jsonl"
    records = [
        {"id": f"conv{i}", "messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
        for i in range(20)
    ]
    transcript.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    command = [sys.executable, "-m", "clm_middleware.cli.main", "replay", str(transcript), "--model", "tiny"]
    command += ["--mode", "clm", "--teacher-force", "--db", str(db), "--quiet"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    failed = [output[-2000:] for run, output in zip(runs, outputs, strict=True) if run.returncode]
    assert not failed, failed
    ids = Store(db).conversation_ids()
    assert sorted(ids) == sorted([f"many-conv{i}" for i in range(20)] + [f"many-conv{i}#2" for i in range(20)])


def test_a_new_conversation_with_a_stored_id_is_refused_and_the_stored_one_is_untouched(converse, engine, tmp_path):
    from clm_middleware.store import ConversationExistsError

    path = tmp_path / "chats.db"
    first = converse(store=path, system_prompt="Be brief.", conversation_id="maria")
    first.send("My order is 48213-KX.")
    first.close()
    stored = [(m.role, m.content) for m in Conversation.load(path, "maria", engine).history]

    with pytest.raises(ConversationExistsError, match=r"maria.*Conversation\.load"):
        converse(store=path, conversation_id="maria")
    other = converse(conversation_id="maria")
    with pytest.raises(ConversationExistsError):
        other.attach_store(Store(path))
    assert other.store is None  # nothing attached: its turns cannot reach the stored conversation
    other.send("hello")
    assert [(m.role, m.content) for m in Conversation.load(path, "maria", engine).history] == stored


def test_a_conversation_loads_onto_another_model_only_if_its_tokenizer_reads_the_stored_ids(engine, tiny_tok, tmp_path):
    """Segments are stored as token ids: another vocabulary would read them as other text
    (SmolLM2 loading a tiny model's chat showed bytes as random subwords)."""
    from clm_middleware.engine import Engine
    from clm_middleware.errors import ConfigError
    from clm_middleware.models import tiny_llama, tiny_tokenizer

    path = tmp_path / "models.db"
    merging = tiny_tokenizer(merges=[("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "n"), ("Ġ", "in")])
    other_vocabulary = Engine(tiny_llama(seed=3, vocab_size=len(merging)), merging)
    stored = Conversation(other_vocabulary, tagging="rules", store=path, conversation_id="merged", max_new_tokens=4)
    stored.send("Then the thin thread ran in the inn.")
    stored.close()
    with pytest.raises(
        ConfigError, match=r"engine: this conversation \(.*models\.db\) was stored with model 'tiny-llama"
    ):
        Conversation.load(path, "merged", engine)

    same_tokenizer = Conversation(engine, tagging="rules", store=path, conversation_id="plain", max_new_tokens=4)
    same_tokenizer.send("Then the thin thread ran in the inn.")
    context = same_tokenizer.context
    same_tokenizer.close()
    other_weights = Engine(tiny_llama(seed=1), tiny_tok)  # another model name, the same tokenizer: loads
    assert Conversation.load(path, "plain", other_weights).context == context


def test_a_save_that_fails_on_a_held_lock_loses_nothing_and_the_next_save_writes_it(converse, engine, tmp_path):
    import sqlite3

    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    conversation = converse(store=path, conversation_id="locked")
    conversation.send("Turn one.")
    conversation.store.db.conn.execute("PRAGMA busy_timeout = 100")  # fail fast instead of waiting 30 s
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process writes: the store's write lock is taken
    with pytest.raises(StoreError, match=r"chats\.db: cannot write \(database is locked\)"):
        conversation.send("Turn two.")
    other.execute("ROLLBACK")
    other.close()
    conversation.send("Turn three.")  # this save carries turn two as well
    expected = [m.content for m in conversation.history]
    conversation.close()
    loaded = Conversation.load(path, "locked", engine)
    assert [m.content for m in loaded.history] == expected and len(expected) == 6
    assert loaded.context == conversation.context


def test_a_second_writer_of_one_stored_conversation_is_refused_and_the_first_ones_turn_stays(
    converse, engine, tmp_path
):
    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    converse(store=path, conversation_id="shared").send("Hello.")
    first, second = Conversation.load(path, "shared", engine), Conversation.load(path, "shared", engine)
    first.send("I like tea.")
    with pytest.raises(StoreError, match="changed in the store since this object read or wrote it"):
        second.send("I like coffee.")
    assert "I like tea." in [m.content for m in Conversation.load(path, "shared", engine).history]


def test_a_store_with_damaged_pages_is_a_store_error_naming_the_file(converse, engine, tmp_path):
    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    conversation = converse(store=path, conversation_id="hurt")
    for number in range(4):
        conversation.add("user", f"Message {number}: " + "some text about the trip " * 10)
        conversation.respond(forced_reply=f"Reply {number}.")
    conversation.close()
    conversation.store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conversation.store.close()
    data = bytearray(path.read_bytes())
    for page in range(4096, len(data), 4096):  # the header page opens; the tables' pages are garbage
        data[page + 100 : page + 400] = b"\xa5" * 300
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"chats\.db: cannot read \("):
        Conversation.load(path, "hurt", engine)


@pytest.mark.parametrize(
    "damage",
    [
        ("update segments set token_ids = '[1, 2' where idx = 1", r"has a damaged row \(JSONDecodeError"),
        ("delete from segments where idx = 1", r"lacks segments its messages list \(seg_1; damaged\)"),
    ],
)
def test_a_damaged_row_is_a_store_error_naming_the_file_never_a_half_loaded_conversation(
    converse, engine, tmp_path, damage
):
    """A raw JSONDecodeError traceback, or a load that passed and a KeyError at .context later
    (a helper's sweep)."""
    from clm_middleware.store import StoreError

    statement, message = damage
    path = tmp_path / "chats.db"
    conversation = converse(store=path, conversation_id="hurt")
    conversation.send("My order is 48213-KX.")
    conversation.close()
    with Database(path) as database:
        database.execute(statement)
        database.conn.commit()
    with pytest.raises(StoreError, match=r"chats\.db: conversation 'hurt' " + message):
        Conversation.load(path, "hurt", engine)


def test_a_reload_shows_the_tools_section_and_the_prompts_the_conversation_had(converse, engine, tmp_path):
    path = tmp_path / "chats.db"
    custom = "Label every segment. Custom words for this test."
    conversation = converse(store=path, conversation_id="tools", tagging="free", protocol_prompt=custom)
    conversation.set_tools_prompt("You may call get_weather(city).")
    conversation.send("What is the weather in Porto?")
    expected = conversation.render_prompt(None).token_ids
    conversation.close()
    loaded = Conversation.load(path, "tools", engine)
    assert loaded.tools_prompt == "You may call get_weather(city)." and loaded.protocol_text == custom
    assert loaded.render_prompt(None).token_ids == expected


def test_what_was_added_before_the_first_reply_is_saved_on_close_and_loads_back(converse, engine, tmp_path):
    """A system prompt and a seeded history were written only with a turn: closed before
    one, the conversation loaded back empty while its id stayed taken (a helper's sweep:
    `clm chat --system ... ` then /quit lost the system prompt for good)."""
    path = tmp_path / "chats.db"
    seeded = converse(store=path, system_prompt="Be brief.", conversation_id="ana")
    seeded.add("assistant", "Hi! How can I help?")
    seeded.add("user", "My order is 48213-KX.")
    context = seeded.context
    seeded.close()
    loaded = Conversation.load(path, "ana", engine)
    assert [(m.role, m.content) for m in loaded.history] == [
        ("system", "Be brief."),
        ("assistant", "Hi! How can I help?"),
        ("user", "My order is 48213-KX."),
    ]
    assert loaded.context == context and loaded.turn == 0
    twin = loaded.fork(len(loaded.history), conversation_id="ana-2")
    twin.close()
    assert [m.content for m in Conversation.load(path, "ana-2", engine).history] == [m.content for m in loaded.history]
    loaded.close()


def test_closing_a_conversation_with_nothing_unsaved_writes_nothing(converse, engine, tmp_path):
    path = tmp_path / "chats.db"
    first = converse(store=path, conversation_id="ro")
    first.send("hello")
    first.close()
    path.chmod(0o444)
    try:
        reader = Conversation.load(Store(path, read_only=True), "ro", engine)
        reader.close()  # a read-only store: a write here would fail
    finally:
        path.chmod(0o644)


def test_a_store_that_cannot_be_created_is_a_store_error_naming_the_path(converse, tmp_path):
    """A raw PermissionError / NotADirectoryError from os.open before (a helper's sweep)."""
    from clm_middleware.store import StoreError

    not_a_folder = tmp_path / "notes.txt"
    not_a_folder.write_text("plain text\n")
    with pytest.raises(StoreError, match=r"notes\.txt/chats\.db: cannot create the store"):
        converse(store=not_a_folder / "chats.db")


def test_settings_a_load_does_not_know_are_named(converse, engine, tmp_path):
    """A stored setting from a newer version, or a mistyped one given to load, was a bare
    TypeError from the constructor (a helper's sweep)."""
    from clm_middleware.errors import ConfigError
    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    conversation = converse(store=path, conversation_id="s")
    conversation.send("hello")
    conversation.close()
    with pytest.raises(ConfigError, match="budgett"):
        Conversation.load(path, "s", engine, budgett=512)
    with Database(path) as database:
        settings = json.loads(next(database.query("select settings from conversations"))["settings"])
        database.execute("update conversations set settings = ?", [json.dumps({**settings, "warp_drive": True})])
        database.conn.commit()
    with pytest.raises(
        StoreError, match=r"chats\.db: conversation 's' has settings this version does not know \(warp_drive\)"
    ):
        Conversation.load(path, "s", engine)


def test_messages_saved_unanswered_and_then_discarded_leave_the_store(converse, engine, tmp_path):
    path = tmp_path / "chats.db"
    first = converse(store=path, conversation_id="drafts")
    first.send("hello")
    for draft in ("draft 1", "draft 2", "draft 3"):
        first.add("user", draft)
    first.close()  # saves the unanswered drafts, as close() does
    second = Conversation.load(path, "drafts", engine)
    second.discard(2)
    second.add("user", "the real question")
    second.respond()
    kept = [(m.role, m.content) for m in second.history]
    second.close()
    reloaded = Conversation.load(path, "drafts", engine)
    assert [(m.role, m.content) for m in reloaded.history] == kept
    assert "draft" not in reloaded.context and reloaded.context == second.context


@pytest.mark.parametrize(
    ("table", "change", "named"),
    [
        ("messages", {"role": "wizard"}, "unknown role 'wizard'"),
        ("messages", {"content": None}, "not text"),
        ("segments", {"role": "wizard"}, "unknown role 'wizard'"),
        ("segments", {"token_ids": "[99999999]"}, "outside the vocabulary"),
        ("segments", {"token_ids": '"abc"'}, "not a list of token ids"),
        ("segments", {"text": None}, "seg_0's text is NoneType, not text"),
        ("segments", {"turn": None}, "seg_0's turn is NoneType"),
        ("segments", {"summary_ids": '"x"'}, "summary ids are not a list of token ids"),
        ("segments", {"summary_ids": "[99999999]"}, "outside the vocabulary"),
        ("conversations", {"settings": "[1, 2]"}, "the settings is list, not an object"),
        ("conversations", {"turn": None}, "the turn counter is NoneType"),
        ("turns", {"stats": "[]"}, "turn 1's stats is list, not an object"),
        ("turns", {"stats": "{}"}, "turn 1's number is NoneType"),
    ],
)
def test_a_stored_row_another_program_damaged_is_refused_at_load_naming_the_file(
    converse, engine, tmp_path, table, change, named
):
    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    chat = converse(store=path, conversation_id="damaged")
    chat.send("hello")
    chat.close()
    store = Store(path)
    keys = {"messages": ("damaged", 0), "segments": ("damaged", "seg_0"), "conversations": "damaged"}
    store.db[table].update(keys.get(table, ("damaged", 1)), change)
    with pytest.raises(StoreError, match=rf"chats\.db.*{re.escape(named)}"):
        Conversation.load(Store(path), "damaged", engine)


@pytest.mark.parametrize("loss", ["rows", "table"])
def test_a_conversation_whose_messages_are_gone_is_refused_at_load_not_continued_without_them(
    converse, engine, tmp_path, loss
):
    from clm_middleware.store import StoreError

    path = tmp_path / "chats.db"
    chat = converse(store=path, conversation_id="damaged")
    chat.send("hello")
    chat.close()
    store = Store(path)
    if loss == "rows":
        store.db["messages"].delete_where("conversation_id = ?", ["damaged"])
    else:
        store.db["messages"].drop()
    with pytest.raises(StoreError, match=r"chats\.db.*(lost its messages|messages table is gone)"):
        Conversation.load(Store(path), "damaged", engine)


def test_every_folder_a_new_store_creates_is_owner_only(converse, tmp_path):
    path = tmp_path / "new" / "sub" / "chats.db"
    converse(store=path).send("hello")
    assert [oct(folder.stat().st_mode & 0o777) for folder in (path.parent, path.parent.parent)] == ["0o700", "0o700"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_settings_a_config_or_generation_of_ones_own_set_come_back_on_load(engine, tmp_path):
    from clm_middleware.lifecycle.config import GenerationSettings, LifecycleConfig

    path = tmp_path / "chats.db"
    config = LifecycleConfig(budget=300, low_water=0.5, recent_share=0.5, target_ratio=2.0, protect_turns=2)
    generation = GenerationSettings(max_new_tokens=8, logit_bias=((5, -100.0),), cut_repeats=False, end_after=("zz",))
    chat = Conversation(engine, config=config, generation=generation, store=path, conversation_id="own")
    chat.send("hello")
    chat.close()
    loaded = Conversation.load(path, "own", engine)
    assert loaded.config == config and loaded.generation == generation
    assert Conversation.load(path, "own", engine, budget=512).config == dataclasses.replace(config, budget=512)


def test_a_store_attached_after_some_turns_holds_every_turns_stats(converse, engine, tmp_path):
    """attach_store (clm chat's /save) wrote the earlier turns' messages and decisions but
    not their stats: clm stats listed only the turns after it, and a reload said turn 1."""
    conversation = converse(conversation_id="late")
    conversation.send("My name is Ana.")
    conversation.send("I live in Lisbon.")
    conversation.attach_store(Store(tmp_path / "late.db"))
    conversation.send("What is my name?")
    conversation.close()
    loaded = Conversation.load(tmp_path / "late.db", "late", engine)
    assert [t.turn for t in loaded.turn_log] == [1, 2, 3]
    assert loaded.stats()["prompt_tokens"] == sum(t.prompt_tokens for t in conversation.turn_log)
    loaded.close()


def test_a_directory_given_as_a_store_is_named_as_one(tmp_path):
    from clm_middleware.store import StoreError

    for read_only in (False, True):
        with pytest.raises(StoreError, match="is a directory"):
            Store(tmp_path, read_only=read_only)


def test_a_store_in_a_read_only_directory_is_read_as_immutable_unless_unmerged_writes_lie_beside(
    converse, tmp_path, monkeypatch
):
    """SQLite cannot make a WAL store's -shm file in a read-only directory, so even a
    read failed there ("not a usable SQLite store", a helper's sweep on a read-only mount).
    The directory's write access and the first open's failure are simulated here (tests
    may run as root); the fallback's own open is real."""
    import sqlite3

    from clm_middleware.store import StoreError

    store = Store(tmp_path / "kept.db")
    conversation = converse(store=store, conversation_id="k")
    conversation.send("My order is 42.")
    conversation.close()
    store.close()
    real = Store._connect_read_only

    def no_shm(self, mode):
        if mode == "mode=ro":
            raise sqlite3.OperationalError("unable to open database file")
        real(self, mode)

    monkeypatch.setattr(Store, "_connect_read_only", no_shm)
    monkeypatch.setattr(os, "access", lambda path, how: False)
    read = Store(tmp_path / "kept.db", read_only=True)
    assert read.db["turns"].count_where("conversation_id = 'k'") == 1
    read.close()
    (tmp_path / "kept.db-wal").write_bytes(b"unmerged")
    with pytest.raises(StoreError, match="writes not merged yet"):
        Store(tmp_path / "kept.db", read_only=True)


def test_a_fork_is_stored_with_the_turns_of_the_history_it_shares(converse, engine, tmp_path):
    """clm stats on a fork (clm serve's edited histories, ChatCLM's) had shown none of the
    turns its history came from: it was stored without their rows."""
    path = tmp_path / "chats.db"
    original = converse(store=path, conversation_id="ana")
    original.send("My order is 48213-KX.")
    original.send("When does it arrive?")
    twin = original.fork(len(original.history), conversation_id="ana-2")
    assert [t.turn for t in twin.turn_log] == [1, 2] and twin.stats()["turns"] == 2
    twin.send("Thanks!")
    twin.close()
    original.close()
    loaded = Conversation.load(path, "ana-2", engine)
    assert [t.turn for t in loaded.turn_log] == [1, 2, 3]
    assert [t.prompt_tokens for t in loaded.turn_log[:2]] == [t.prompt_tokens for t in original.turn_log]
    loaded.close()


def test_loading_by_path_never_writes_a_file_that_is_not_a_store_is_refused_as_it_is(engine, tmp_path):
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(StoreError, match=r"empty\.db: not a clm-middleware store"):
        Conversation.load(empty, "x", engine)
    assert empty.read_bytes() == b""  # the schema had been written into it, then "no conversation"


def test_a_store_whose_directory_is_read_only_loads_by_path_and_leaves_the_file_as_it_was(
    converse, engine, tmp_path, monkeypatch
):
    """A read-only directory is simulated (tests may run as root): its write access is
    refused, and so is any open for writing, as SQLite refuses it there ("attempt to
    write a readonly database"); the load used to open the store for writing."""
    path = tmp_path / "chats.db"
    chat = converse(store=path, conversation_id="ro")
    chat.send("My order is 42.")
    said = [(m.role, m.content) for m in chat.history]
    chat.close()
    before = path.read_bytes()
    real_init = Store.__init__

    def reads_only(self, where, *, read_only=False):
        if not read_only:
            raise StoreError(f"{where}: not a usable SQLite store (attempt to write a readonly database)")
        real_init(self, where, read_only=True)

    monkeypatch.setattr(Store, "__init__", reads_only)
    monkeypatch.setattr(os, "access", lambda _path, _how: False)
    loaded = Conversation.load(path, "ro", engine, system_prompt=None)  # None: the stored one
    monkeypatch.undo()
    assert [(m.role, m.content) for m in loaded.history] == said
    loaded.abandon()
    assert path.read_bytes() == before


@pytest.mark.parametrize(("stored", "now"), [("free", "signals"), ("signals", "free")])
def test_a_tagging_given_at_load_decides_whether_the_protocol_is_shown(converse, engine, tmp_path, stored, now):
    path = tmp_path / "chats.db"
    chat = converse(store=path, conversation_id="t", tagging=stored)
    chat.send("My order is 42.")
    assert chat.protocol_context == (stored == "free")
    chat.close()
    loaded = Conversation.load(path, "t", engine, tagging=now)
    assert loaded.protocol_context == (now == "free")
    kept = Conversation.load(path, "t", engine)  # no tagging given: as stored
    assert kept.protocol_context == (stored == "free")


def test_settings_a_load_cannot_honour_are_refused_and_use_pool_is_kept(converse, engine, tmp_path):
    from clm_middleware.errors import ConfigError, ContextBudgetError

    path = tmp_path / "chats.db"
    chat = converse(store=path, conversation_id="s", system_prompt="You are terse. " * 8, use_pool=False)
    chat.send("hello")
    chat.close()
    with pytest.raises(ConfigError, match="system_prompt"):  # it was ignored: the stored one stood
        Conversation.load(path, "s", engine, system_prompt="You are a pirate.")
    with pytest.raises(ContextBudgetError):  # a fresh conversation refuses it at construction too
        Conversation.load(path, "s", engine, budget=64)
    assert Conversation.load(path, "s", engine).use_pool is False
