"""The live index: a turn scans the messages that can still matter, and decides as if it scanned all."""

from __future__ import annotations

from clm_middleware import Conversation
from clm_middleware.lifecycle.segments import Status


def _facts_chat(conversation: Conversation, turns: int) -> list[tuple[list[int], list[tuple[str, str, str]]]]:
    """Turns whose messages share numbers with earlier ones (references bring segments
    back) under a small budget (compaction folds, drops and compresses); per turn the
    context ids and the decisions taken."""
    seen = []
    for index in range(turns):
        conversation.add("user", f"Order {index} goes to gate {index % 7} at {index % 5 + 1}:15 pm, thanks a lot.")
        reply = conversation.respond(f"Noted order {index}, gate {index % 7}.")
        decisions = [(d.segment_id, d.label.value, d.reason) for d in reply.decisions]
        seen.append((conversation.context_ids, decisions))
    return seen


def test_a_conversation_decides_the_same_with_the_live_index_as_scanning_every_message(
    converse, make_engine, monkeypatch
):
    live = _facts_chat(converse(budget=256, max_new_tokens=2, engine=make_engine()), 90)
    monkeypatch.setattr(Conversation, "live_messages", lambda self: list(self.messages))
    everything = _facts_chat(converse(budget=256, max_new_tokens=2, engine=make_engine()), 90)
    assert live == everything
    assert any(decisions for _, decisions in live)  # the chat compacts: there is something to decide


def test_the_live_messages_stay_bounded_while_the_history_grows(converse):
    conversation = converse(budget=256, max_new_tokens=2)
    sizes = []
    for index in range(120):
        conversation.add("user", f"Order {index} goes to gate {index % 9}, thanks.")
        conversation.respond(f"Noted order {index}.")
        sizes.append(len(conversation.live_messages()))
    assert len(conversation.history) == 240
    assert max(sizes[-20:]) <= max(sizes[30:50]) + 8


def test_a_segment_removed_more_than_k_rounds_ago_leaves_the_live_index_and_pin_brings_it_back(converse):
    conversation = converse(budget=256, max_new_tokens=2)
    first = conversation.send("My locker code is 4417.")
    target = conversation.segment(conversation.history[0].segment_ids[0])
    conversation.forget(target.id)
    words = ["apples", "rivers", "clouds", "lamps", "chairs", "boats", "roads", "trees"]
    for index in range(conversation.config.k + 2):
        conversation.send(f"Tell me about {words[index % len(words)]}.")
    assert first.text is not None
    assert target.status is Status.DROPPED
    assert all(m.index != target.message_index for m in conversation.live_messages())
    conversation.pin(target.id)
    assert target.visible
    assert any(m.index == target.message_index for m in conversation.live_messages())
    conversation.send("And one more.")
    assert "4417" in conversation.context


def test_discarding_a_failed_turns_message_leaves_the_live_index_consistent(converse):
    import pytest

    from clm_middleware.lifecycle.compaction import ContextBudgetError

    conversation = converse(budget=128, max_new_tokens=2)
    conversation.send("A first short message.")
    before = len(conversation.history)
    conversation.add("user", "word " * 400)
    with pytest.raises(ContextBudgetError):
        conversation.respond()  # the turn started (the index saw the message), then failed
    conversation.discard(before)
    assert [m.index for m in conversation.live_messages()] == [m.index for m in conversation.history]
    conversation.send("A second short message.")
    assert len(conversation.history) == before + 2
