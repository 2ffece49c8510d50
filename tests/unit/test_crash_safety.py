"""A process killed (SIGKILL) in the middle of a turn leaves a consistent store."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from clm_middleware.conversation import Conversation
from clm_middleware.store import Store

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine
    from clm_middleware.models import tiny_llama, tiny_tokenizer

    path, where = sys.argv[1], sys.argv[2]
    engine = Engine(tiny_llama(), tiny_tokenizer())
    chat = Conversation(
        engine, store=path, conversation_id="c", tagging="signals", max_new_tokens=4, system_prompt="Be brief."
    )
    for text in ("My code is 4471.", "ok thanks", "What about rivers and valleys?") if where != "first turn" else ():
        chat.send(text)

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if where in ("generation", "first turn"):
        engine.logits_processors = (lambda generated, logits: die() if generated else logits,)
    else:  # inside the turn's transaction, after the messages were written
        from sqlite_utils.db import Table
        original = Table.upsert_all
        def write_then_die(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if self.name == "messages":
                die()
            return result
        Table.upsert_all = write_then_die
    chat.send("And the weather tomorrow?")
    print("not killed")
    """
)


@pytest.mark.parametrize("where", ["generation", "transaction"])
def test_a_turn_killed_midway_leaves_the_store_at_its_last_complete_turn(engine, tmp_path, where):
    path = tmp_path / "chats.db"
    child = subprocess.run([sys.executable, "-c", CHILD, str(path), where], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    store = Store(path)
    assert store.db.execute("pragma integrity_check").fetchone()[0] == "ok"
    conversation = Conversation.load(store, "c", engine)
    assert conversation.turn == 3
    assert [m.role for m in conversation.history] == ["system"] + ["user", "assistant"] * 3
    turns = [row["turn"] for row in store.rows("turns", "c", "turn")]
    assert turns == [1, 2, 3]
    segments = {s.id for s in conversation.segments}
    assert all(set(json.loads(row["segment_ids"])) <= segments for row in store.rows("messages", "c", "idx"))
    assert "4471" in conversation.context
    reply = conversation.send("Still there?")  # the conversation goes on from its last complete turn
    assert reply.turn == 4
    conversation.close()


def test_a_first_turn_killed_midway_keeps_the_system_prompt_and_abandon_leaves_no_row(engine, tmp_path):
    """The row is written when the conversation is made; its system prompt had been saved
    only with the first turn, so a process killed in that turn left a row without one,
    which a resume (``clm chat --db F --session S``) continued with no system prompt."""
    path = tmp_path / "chats.db"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "first turn"], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    conversation = Conversation.load(Store(path), "c", engine)
    assert [(m.role, m.content) for m in conversation.history] == [("system", "Be brief.")]
    assert conversation.turn == 0 and conversation.send("Hello?").turn == 1
    conversation.close()
    failed = Conversation(engine, store=path, conversation_id="f", system_prompt="Be brief.")
    failed.abandon()  # a first call that failed: nothing of it stays, its system prompt included
    store = Store(path)
    assert store.rows("messages", "f", "idx") == [] and "f" not in {row["id"] for row in store.db["conversations"].rows}
