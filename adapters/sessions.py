"""Map the whole histories LangChain sends onto managed conversations.

LangChain re-sends every message on every call. The router recognises a history by
its message digests (see ``messages.py``):

- it extends a known conversation → only the new messages are added;
- it diverges from one (an edited message, a retried answer) → the best match is
  forked at the common prefix, whose segments and blocks are shared;
- it is new → a new conversation.

A caller may name the conversation (``session_id``); the name then follows the latest
branch, and a history is matched against every open branch made under that name (a
chat UI that regenerates an answer, then goes back to the first one, extends that one
again; two clients that share a name keep a branch each). A conversation serves one
call at a time: a call whose history continues one that another call holds waits for it
(``BUSY_WAIT_S``: a stopped turn is being undone) and extends it if it comes back as the
history says, else forks (a concurrent call with the same history).
Idle conversations beyond ``max_sessions`` are closed, least recently used first (their
state stays in the store, if one is set; a later call under the same name starts a new
conversation, stored under a suffixed id). Given the engine's ``pool``, the router also
answers its pressure: when a request finds the pool too full, idle conversations give
back the blocks they hold between turns, least recently used first
(``Conversation.release_cache``); they stay open, and their next turn reuses whatever
of those blocks the pool still caches.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.conversation import Conversation
from clm_middleware.errors import ConversationBusyError
from clm_middleware.lifecycle.reply import shared_prefix_length
from clm_middleware.store import ConversationExistsError

from .messages import Turn

MAX_SESSIONS = 64
# how long a call whose history continues a busy conversation whole waits for it before
# forking: a stopped turn is undone within a token or two, plus clm serve's 0.25 s poll
# for a client that left; a concurrent call with the same history forks after it
BUSY_WAIT_S = 2.0


@dataclass(slots=True)
class Session:
    conversation: Conversation
    digests: list[str] = field(default_factory=list)  # of the messages the conversation holds, in order
    busy: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    session: Session
    new_turns: list[Turn]
    kind: str  # "new" | "extend" | "fork"
    session_id: str | None = None  # the caller's name for it, if any
    named_before: str | None = None  # the conversation that name led to before this call


class SessionRouter:
    def __init__(
        self,
        make_conversation: Callable[[str], Conversation],
        max_sessions: int = MAX_SESSIONS,
        namespace: str = "",
        pool: Any = None,
    ) -> None:
        self._make = make_conversation
        self.namespace = namespace  # prefix of every conversation id (a tenant's, in a shared store)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._names: dict[str, str] = {}  # session_id → conversation id (its latest branch)
        self._branches: dict[str, list[str]] = {}  # session_id → conversation ids made under it
        # re-entrant: making a conversation may run the engine, whose pool may then ask
        # this router for room (``give_back_cache``) from the same thread
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a call leaves a session
        self.max_sessions = max_sessions
        self.evicted = 0  # idle sessions closed to stay within max_sessions
        self.caches_released = 0  # idle sessions that gave their blocks back under pool pressure
        # a pool that can ask for room (cache.block_pool.BlockPool; a remote engine's has none)
        self._pool = pool if hasattr(pool, "add_pressure_listener") else None
        self._listener = _PressureListener(self) if self._pool is not None else None
        if self._listener is not None:
            self._pool.add_pressure_listener(self._listener)
        # a router dropped without close() (its ChatCLM went out of scope) still gives its
        # conversations' blocks back to the shared pool, and leaves no listener behind
        self._closer = weakref.finalize(self, _close_when_collected, self._sessions, self._pool, self._listener)

    def route(self, turns: Sequence[Turn], session_id: str | None = None) -> Route:
        """Pick (and mark busy) the conversation to answer ``turns`` with. A blank
        ``session_id`` names nothing: the history alone routes the call."""
        if session_id is not None and not session_id.strip():
            session_id = None
        digests = [t.digest for t in turns]
        deadline = time.monotonic() + BUSY_WAIT_S
        with self._lock:
            while (route := self._choose(turns, digests, session_id)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    route = self._choose(turns, digests, session_id, wait=False)
                    break
                self._idle.wait(left)
            assert route is not None
            route.session.busy = True
            self._sessions.move_to_end(route.session.conversation.id)
            return route

    def _choose(
        self, turns: Sequence[Turn], digests: list[str], session_id: str | None, wait: bool = True
    ) -> Route | None:
        """The route of ``turns`` now (the lock held); None, with ``wait``, where the history
        continues a conversation whole that a call still holds: a caller that stopped a
        stream and sent the same history again at once found the stopped turn not yet
        undone, and forked a branch per stop (a helper's probe, ChatCLM and clm serve)."""
        named_before = self._names.get(session_id) if session_id is not None else None
        if session_id is not None:  # the latest branch first: it wins a tie
            mine = [named_before, *(c for c in self._branches.get(session_id, ()) if c != named_before)]
            candidates = [self._sessions[c] for c in mine if c in self._sessions]
        else:
            candidates = list(self._sessions.values())
        best, common = None, 0
        # the longest idle conversation the history continues whole; of two alike, the one
        # used last (unnamed candidates come least recently used first; a name's latest
        # branch comes first and wins a tie): a fork answered last is the one extended
        extend, extended = None, 0
        for session in candidates:
            shared = shared_prefix_length(session.digests, digests)
            if shared > common or (best is None and shared == common and session_id is not None):
                best, common = session, shared
            continues = not session.busy and 0 < shared == len(session.digests)
            if continues and (shared > extended or (shared == extended and session_id is None)):
                extend, extended = session, shared
        # a history that continues a conversation whole extends it, even where another
        # shares more of it: a client replaying a chat another client had (a scripted
        # opening, a retried conversation) keeps its own branch instead of forking the
        # other's at every turn (blocks the two hold alike are cache hits either way)
        if extend is not None:
            best, common = extend, extended
        if wait and best is not None and best.busy and 0 < common == len(best.digests) <= len(digests):
            return None
        if best is not None and not best.busy and common == len(best.digests) and common <= len(digests):
            route = Route(best, list(turns[common:]), "extend")
        elif best is not None and common > 0:
            route = Route(self._fork(best, common, digests[:common]), list(turns[common:]), "fork")
        else:
            conversation_id = self.namespace + (session_id or uuid.uuid4().hex)
            route = Route(self._add(Session(self._new_conversation(conversation_id))), list(turns), "new")
        route = Route(route.session, route.new_turns, route.kind, session_id, named_before)
        if session_id is not None:
            cid = route.session.conversation.id
            self._names[session_id] = cid
            branches = self._branches.setdefault(session_id, [])
            if cid not in branches:
                branches.append(cid)
        return route

    def done(self, session: Session, digests: Sequence[str]) -> None:
        """The call finished: ``digests`` are now the conversation's messages. Only now,
        beyond ``max_sessions``, do idle sessions other than this one close: a call that
        fails (and abandons the session it made) closes none."""
        with self._lock:
            session.digests = list(digests)
            session.busy = False
            self._evict_idle(keep=session)
            self._idle.notify_all()

    def abandon(self, route: Route) -> None:
        """Undo a ``new`` or ``fork`` route whose call failed: the conversation it created
        goes (with its store row, never saved to), and the caller's name leads where it
        led before. The router is then as it was before the call."""
        with self._lock:
            cid = route.session.conversation.id
            self._sessions.pop(cid, None)
            self._unname(cid)
            if route.session_id is not None and route.named_before in self._sessions:
                self._names[route.session_id] = route.named_before
            self._idle.notify_all()
        route.session.conversation.abandon()

    def forget(self, session: Session) -> None:
        """Close ``session`` and drop it and its names (a call left it out of step)."""
        with self._lock:
            cid = session.conversation.id
            self._sessions.pop(cid, None)
            self._unname(cid)
            self._idle.notify_all()
        session.conversation.close()

    def sessions(self) -> list[Session]:
        """The open sessions, least recently used first."""
        with self._lock:
            return list(self._sessions.values())

    def named(self, session_id: str) -> Session | None:
        """The latest branch of the session a caller named ``session_id``, else the session
        of that conversation id."""
        with self._lock:
            return self._sessions.get(self._names.get(session_id, session_id))

    def listed(self, key: str) -> Session | None:
        """The session of conversation id ``key`` (as a server lists its sessions), else
        the latest branch of the session named ``key``. An id comes first: a named
        session's first conversation has the name as its id, so under ``named`` that id
        would reach the name's latest branch instead, and deleting every listed id would
        close one branch twice and leave another open."""
        with self._lock:
            found = self._sessions.get(key)
            return found if found is not None else self._sessions.get(self._names.get(key, key))

    def branches(self, name: str) -> list[Session]:
        """Every open branch of the session a caller named ``name`` (none for a name never given)."""
        with self._lock:
            return [self._sessions[c] for c in self._branches.get(name, ()) if c in self._sessions]

    def give_back_cache(self, num_blocks: int) -> None:
        """The pool is short of ``num_blocks``: idle conversations release the blocks they
        hold between turns, least recently used first, until the pool has the room (or
        none is left to ask). A busy one is never touched."""
        if self._pool is None:
            return
        with self._lock:
            for session in list(self._sessions.values()):
                if self._pool.can_allocate(num_blocks):
                    return
                if not session.busy and session.conversation.release_cache():
                    self.caches_released += 1

    def close(self) -> None:
        with self._lock:
            if self._closer.detach() is not None:  # not collected, not closed before
                if self._listener is not None:
                    self._pool.remove_pressure_listener(self._listener)
                _close_all(self._sessions)
            self._names.clear()
            self._branches.clear()

    def __len__(self) -> int:
        return len(self._sessions)

    def _new_conversation(self, conversation_id: str) -> Conversation:
        """A new conversation named ``conversation_id``, or a suffixed twin of the name when
        an open session or the store (a closed session's, an earlier process's) holds it:
        a stored conversation is never overwritten, and the caller re-sends its history."""
        if conversation_id not in self._sessions:
            try:
                return self._make(conversation_id)
            except ConversationExistsError:
                pass
        return self._make(f"{conversation_id}~{uuid.uuid4().hex[:8]}")

    def _fork(self, source: Session, common: int, digests: list[str]) -> Session:
        # the first branch's id and a fresh suffix: a client that forks on every call (it
        # edits the replies it sends back) gets ids of one length, not ever longer ones
        root = source.conversation.id.split("~", 1)[0]
        twin = source.conversation.fork(common, conversation_id=f"{root}~{uuid.uuid4().hex[:8]}")
        return self._add(Session(twin, list(digests)))

    def _unname(self, cid: str) -> None:
        """Forget conversation ``cid`` under every name (it is closed or abandoned); a name
        whose latest branch it was leads nowhere until its next call."""
        self._names = {name: known for name, known in self._names.items() if known != cid}
        for name, branches in list(self._branches.items()):
            if cid in branches:
                branches.remove(cid)
                if not branches:
                    del self._branches[name]

    def _add(self, session: Session) -> Session:
        self._sessions[session.conversation.id] = session
        return session

    def _evict_idle(self, keep: Session) -> None:
        while len(self._sessions) > self.max_sessions:
            victim = next((s for s in self._sessions.values() if not s.busy and s is not keep), None)
            if victim is None:
                return
            del self._sessions[victim.conversation.id]
            self._unname(victim.conversation.id)
            victim.conversation.close()
            self.evicted += 1


class _PressureListener:
    """The pool's pressure listener for one router, holding it weakly: the shared pool
    never keeps a dropped router (and its conversations) alive."""

    def __init__(self, router: SessionRouter) -> None:
        self._router = weakref.ref(router)

    @property
    def alive(self) -> bool:
        return self._router() is not None

    def __call__(self, num_blocks: int) -> None:
        router = self._router()
        if router is not None:
            router.give_back_cache(num_blocks)


def _close_all(sessions: OrderedDict[str, Session]) -> None:
    """Close every conversation of ``sessions`` (their blocks go back to the pool); one
    whose turn still runs in another thread (a shutdown that outlasted its grace period)
    is left to end, without its store row when it never saved a turn, and the others
    are closed all the same."""
    for session in sessions.values():
        try:
            session.conversation.close()
        except ConversationBusyError:
            session.conversation.forget_unsaved_row()
    sessions.clear()


def _close_when_collected(sessions: OrderedDict[str, Session], pool: Any, listener: _PressureListener | None) -> None:
    """A router was collected without ``close()``: stop listening to ``pool``, and close its
    conversations at the pool's next allocation (the collector may run this while the
    pool is mid-operation in this thread; ``BlockPool.call_soon``)."""
    if pool is None:
        _close_all(sessions)
        return
    pool.remove_pressure_listener(listener)
    pool.call_soon(lambda: _close_all(sessions))
