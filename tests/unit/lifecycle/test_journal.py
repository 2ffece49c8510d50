"""The change journal, and the direction of the store's dependencies."""

import ast
from pathlib import Path

import clm_middleware.store
from clm_middleware.lifecycle.journal import ChangeJournal
from clm_middleware.lifecycle.segments import MessageRecord, SegmentId


def _messages(n: int) -> list[MessageRecord]:
    return [
        MessageRecord(index=i, role="user", content=f"m{i}", turn=i, segment_ids=[SegmentId(f"seg_{i}")])
        for i in range(n)
    ]


def test_pending_hands_over_every_message_from_the_first_changed_one_until_saved():
    messages = _messages(5)
    journal = ChangeJournal()
    journal.message(messages[3])
    journal.message(messages[1])
    changes = journal.pending(messages, {})
    assert [m.index for m in changes.messages] == [1, 2, 3, 4]
    journal.message(messages[4])  # a save failed, the next turn changed more: all of it is still pending
    assert [m.index for m in journal.pending(messages, {}).messages] == [1, 2, 3, 4]
    journal.saved()
    assert journal.pending(messages, {}).messages == []


def test_forgetting_discarded_messages_keeps_the_unsaved_ones_before_them():
    messages = _messages(4)
    segments = {s: object() for m in messages for s in m.segment_ids}
    journal = ChangeJournal()
    journal.everything(messages[1:])
    journal.forget(messages[2:])
    changes = journal.pending(messages[:2], segments)
    assert [m.index for m in changes.messages] == [1]
    assert [segments[SegmentId("seg_1")]] == changes.segments


def test_forgetting_every_unsaved_message_leaves_nothing_to_write():
    messages = _messages(3)
    journal = ChangeJournal()
    journal.everything(messages[2:])
    journal.forget(messages[2:])
    changes = journal.pending(messages[:2], {})
    assert changes.messages == [] and changes.segments == []


def test_the_store_package_imports_neither_conversation_nor_engine():
    package = Path(clm_middleware.store.__file__).parent
    imported = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert not {m for m in imported if m.startswith(("clm_middleware.conversation", "clm_middleware.engine"))}
