"""Idle conversations give their blocks back when the shared pool runs short (sessions.py)."""

import gc

import pytest

from clm_middleware.adapters import ChatCLM
from clm_middleware.adapters.messages import Turn, turn_digest
from clm_middleware.adapters.sessions import SessionRouter, _PressureListener
from clm_middleware.conversation import Conversation
from clm_middleware.errors import PoolTooSmallError


def _turn(role: str, text: str) -> Turn:
    return Turn(role, text, turn_digest(role, text))


def _answered(router: SessionRouter, text: str):
    """Route a one-message history and answer it, as a chat call does; the session."""
    route = router.route([_turn("user", text)])
    conversation = route.session.conversation
    conversation.add("user", text)
    reply = conversation.respond()
    router.done(route.session, [_turn("user", text).digest, turn_digest("assistant", reply.text)])
    return route.session


def test_new_chats_are_answered_when_idle_chats_hold_the_whole_pool(make_engine):
    engine = make_engine(max_blocks=12)
    llm = ChatCLM(engine=engine, tagging="signals", max_tokens=4)
    first = [("user", "chat number 0: tell me about the weather")]
    reply = llm.invoke(first)
    for number in range(1, 8):  # each a new conversation; together they would hold far more than 12 blocks
        assert isinstance(llm.invoke(f"chat number {number}: tell me about the weather").content, str)
    engine.pool.check_invariants()
    # the first chat gave its blocks back but stays open: its next call extends it
    again = llm.invoke([*first, ("assistant", reply.content), ("user", "and tomorrow?")])
    assert again.response_metadata["conversation_id"] == reply.response_metadata["conversation_id"]


def test_under_pressure_only_idle_sessions_give_back_least_recently_used_first(make_engine):
    engine = make_engine(max_blocks=64)
    make = lambda cid: Conversation(engine, conversation_id=cid, tagging="signals", max_new_tokens=4)  # noqa: E731
    router = SessionRouter(make, pool=engine.pool)
    oldest, newer = _answered(router, "the first chat"), _answered(router, "the second chat")
    busy = router.route([_turn("user", "a third chat, answering now")]).session
    busy.conversation.add("user", "a third chat, answering now")
    busy.conversation.respond()  # holds its chain; the router still marks it busy
    held = {s.conversation.id: s.conversation.stats()["held_blocks"] for s in (oldest, newer, busy)}
    assert all(held.values())
    available = engine.pool.available_blocks()
    router.give_back_cache(available + 1)  # one block more than there is: the oldest suffices
    assert oldest.conversation.stats()["held_blocks"] == 0
    assert newer.conversation.stats()["held_blocks"] == held[newer.conversation.id]
    router.give_back_cache(engine.pool.num_blocks)  # more than anyone can give: every idle one gives
    assert newer.conversation.stats()["held_blocks"] == 0
    assert busy.conversation.stats()["held_blocks"] == held[busy.conversation.id]  # a busy one is never touched
    assert router.caches_released == 2
    router.close()
    assert engine.pool.stats().blocks_in_use == 0


def test_a_dropped_router_gives_its_blocks_back_and_stops_listening(make_engine):
    engine = make_engine(max_blocks=64)
    make = lambda cid: Conversation(engine, conversation_id=cid, tagging="signals", max_new_tokens=4)  # noqa: E731
    router = SessionRouter(make, pool=engine.pool)
    _answered(router, "a chat whose router is dropped")
    assert engine.pool.stats().blocks_in_use > 0
    del router
    gc.collect()
    assert not any(isinstance(listener, _PressureListener) for listener in engine.pool._pressure_listeners)
    # the collector may run inside the pool: the blocks go back at its next allocation
    taken = engine.pool.allocate(1)
    assert engine.pool.stats().blocks_in_use == 1
    engine.pool.release(taken)
    engine.pool.check_invariants()


def test_a_chat_larger_than_the_whole_pool_is_refused_as_too_long(make_engine):
    llm = ChatCLM(engine=make_engine(max_blocks=4), tagging="signals", max_tokens=4)
    with pytest.raises(PoolTooSmallError, match="the pool has 4 in all"):
        llm.invoke("a message much longer than four blocks of sixteen tokens " * 3)


def test_idle_conversations_on_one_engine_give_their_blocks_back_least_recently_used_first(make_engine):
    engine = make_engine(max_blocks=12)
    chats = [Conversation(engine, tagging="signals", max_new_tokens=4) for _ in range(6)]
    for number, chat in enumerate(chats):  # together they would hold far more than 12 blocks
        chat.send(f"conversation number {number}: tell me about the weather")
    assert chats[0].stats()["held_blocks"] == 0  # the oldest gave its chain back first
    assert chats[-1].stats()["held_blocks"] > 0  # the one just answered still holds its chain
    assert chats[0].send("and tomorrow?").turn == 2  # it stays usable
    engine.pool.check_invariants()


def test_a_conversation_whose_turn_runs_keeps_its_blocks_when_another_thread_is_short(scripted):
    import threading

    from clm_middleware.errors import PoolExhaustedError

    engine, _ = scripted("An earlier answer.", "A long answer that is still streaming word by word.")
    busy = Conversation(engine, tagging="signals", max_new_tokens=32)
    busy.send("an earlier turn")
    held = busy.stats()["held_blocks"]
    stream = busy.stream("a turn still streaming")
    next(stream)  # its turn runs, holding the conversation
    refused = []

    def short_of_room() -> None:
        try:
            engine.pool.allocate(engine.pool.available_blocks() + 1)
        except PoolExhaustedError as error:
            refused.append(error)

    other = threading.Thread(target=short_of_room)
    other.start()
    other.join(timeout=30)
    assert refused and busy.stats()["held_blocks"] >= held  # not released from another thread mid-turn
    assert "".join(stream)  # the turn ends as it would have


def test_the_pool_forgets_the_listeners_of_collected_conversations(make_engine):
    engine = make_engine(max_blocks=64)
    for _ in range(20):
        Conversation(engine, tagging="signals", max_new_tokens=4).send("a one-off question")
    gc.collect()
    Conversation(engine, tagging="signals", max_new_tokens=4)  # registering prunes the dead
    assert len(engine.pool._pressure_listeners) == 1


def test_a_stream_left_open_in_one_thread_is_closed_by_the_next_call_from_another(scripted):
    import threading

    engine, _ = scripted("A long answer that is still streaming word by word.", "The next answer.")
    chat = Conversation(engine, tagging="signals", max_new_tokens=32)
    opened = []
    first = threading.Thread(target=lambda: opened.append(next(chat.stream("a question"))))
    first.start()
    first.join(timeout=30)
    assert opened  # left open, unfinished, by a thread that is gone (an async caller's executor)
    reply = []
    second = threading.Thread(target=lambda: reply.append(chat.send("another question")))
    second.start()
    second.join(timeout=30)
    assert reply and reply[0].text == "The next answer." and len(chat.history) == 2
    assert chat.stats()["held_blocks"] > 0
    taken = engine.pool.allocate(engine.pool.available_blocks() + 1)  # short: the idle chat is asked
    assert chat.stats()["held_blocks"] == 0  # it gave its chain back: no turn is counted as running
    engine.pool.release(taken)


def test_a_conversation_dropped_without_close_gives_its_blocks_back(make_engine):
    engine = make_engine(max_blocks=64)
    chat = Conversation(engine, tagging="signals", max_new_tokens=4)
    chat.send("a one-off question")
    chat.send("and a second one")
    assert engine.pool.stats().blocks_in_use > 0
    del chat
    gc.collect()
    # the collector may run inside the pool: the blocks go back at its next allocation
    taken = engine.pool.allocate(1)
    assert engine.pool.stats().blocks_in_use == 1
    engine.pool.release(taken)
    engine.pool.check_invariants()


def test_a_closed_conversation_once_collected_releases_nothing_twice(make_engine):
    engine = make_engine(max_blocks=64)
    chat = Conversation(engine, tagging="signals", max_new_tokens=4)
    chat.send("a one-off question")
    kept = Conversation(engine, tagging="signals", max_new_tokens=4)
    kept.send("a one-off question")  # the same prompt: it shares the first chat's blocks
    held = kept.stats()["held_blocks"]
    chat.close()
    del chat
    gc.collect()
    engine.pool.release(engine.pool.allocate(1))  # runs what the collector deferred
    assert kept.stats()["held_blocks"] == held
    assert engine.pool.stats().blocks_in_use == held  # the shared blocks keep one holder
    engine.pool.check_invariants()


def test_a_listed_conversation_id_reaches_its_conversation_even_where_a_name_shares_it(make_engine):
    engine = make_engine(max_blocks=64)
    make = lambda cid: Conversation(engine, conversation_id=cid, tagging="signals", max_new_tokens=4)  # noqa: E731
    router = SessionRouter(make, pool=engine.pool)
    first = router.route([_turn("user", "one history")], session_id="nm").session
    first.conversation.add("user", "one history")
    first.conversation.respond()
    router.done(first, [_turn("user", "one history").digest])
    other = router.route([_turn("user", "another history")], session_id="nm").session  # the name's new branch
    assert first.conversation.id == "nm" and other.conversation.id != "nm"
    assert router.listed("nm") is first  # the id "nm" is the first conversation's
    assert router.listed(other.conversation.id) is other
    assert router.named("nm") is other  # the name follows its latest branch
    router.close()


def test_a_router_closed_while_a_first_turn_runs_leaves_no_empty_store_row_of_it(tiny_model, tiny_tok, tmp_path):
    """A server's shutdown that outlasted its grace period had left an empty row of a
    conversation whose first turn was still computing; one that saved a turn keeps its row."""
    import threading

    from clm_middleware.engine import Engine
    from clm_middleware.store import Store

    computing, go_on = threading.Event(), threading.Event()

    def hold_the_first_token(generated, logits):
        computing.set()
        go_on.wait(timeout=30)
        return logits

    engine = Engine(tiny_model, tiny_tok, logits_processors=[hold_the_first_token])
    path = tmp_path / "s.db"
    make = lambda cid: Conversation(engine, conversation_id=cid, tagging="signals", max_new_tokens=2, store=path)  # noqa: E731
    router = SessionRouter(make, pool=engine.pool)
    saved = router.route([_turn("user", "an answered chat")]).session
    saved.conversation.add("user", "an answered chat")
    go_on.set()
    saved.conversation.respond()
    router.done(saved, [_turn("user", "an answered chat").digest])
    go_on.clear()
    running = router.route([_turn("user", "a first turn, still computing")]).session
    running.conversation.add("user", "a first turn, still computing")
    worker = threading.Thread(target=running.conversation.respond)
    worker.start()
    assert computing.wait(timeout=30)
    router.close()
    assert Store(path, read_only=True).conversation_ids() == [saved.conversation.id]
    go_on.set()  # a turn that does end after all saves its row anew, whole
    worker.join(timeout=30)
    stored = Store(path, read_only=True).load(running.conversation.id)
    assert stored.record.turn == 1 and [m.role for m in stored.messages] == ["user", "assistant"]


def test_beyond_max_sessions_a_finished_call_closes_the_least_recently_used_idle_one_and_a_failed_call_none(
    make_engine,
):
    engine = make_engine(max_blocks=64)
    make = lambda cid: Conversation(engine, conversation_id=cid, tagging="signals", max_new_tokens=4)  # noqa: E731
    router = SessionRouter(make, max_sessions=2, pool=engine.pool)
    oldest, newer = _answered(router, "the first chat"), _answered(router, "the second chat")
    failed = router.route([_turn("user", "a third chat whose call fails")])
    router.abandon(failed)  # as ChatCall does when the turn raises (a prompt over the window)
    assert router.sessions() == [oldest, newer] and router.evicted == 0
    third = _answered(router, "a third chat, answered")
    assert router.sessions() == [newer, third] and router.evicted == 1
    router.close()
    assert engine.pool.stats().blocks_in_use == 0
