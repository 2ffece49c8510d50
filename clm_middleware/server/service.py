"""What the server serves: one engine, managed conversations per tenant, metrics.

A tenant is an API key (when the server has keys) or else the request's ``user``; the
anonymous tenant is ``None``. Each tenant has its own session router and its own KV
cache salt, so no tenant's request hits another's blocks or sees its sessions, and its
conversation ids are prefixed with the tenant in a shared store.

``mode="stateless"`` is the baseline a plain server is: every request renders the
whole history and computes it from scratch (no pool, no lifecycle), then forgets it.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.adapters.chat_call import ChatCall, ChatRequest
from clm_middleware.adapters.messages import Turn
from clm_middleware.adapters.sessions import MAX_SESSIONS, Route, Session, SessionRouter
from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import GenerationSettings

from .metrics import ServerMetrics

MODES = ("clm", "stateless")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_id: str
    mode: str = "clm"
    budget: int | None = None
    k: int = 2
    tagging: str = "auto"
    compact_ahead: bool = False
    db: str | None = None
    api_keys: tuple[str, ...] = ()
    max_sessions: int = MAX_SESSIONS
    max_concurrent_turns: int = 4  # turns generating at once; more requests wait their turn
    pool_wait_s: float = 60.0  # a request the pool has no room for waits this long for turns to end (pool_room.py)
    generation: GenerationSettings = field(default_factory=lambda: GenerationSettings(max_new_tokens=256))
    # browser origins allowed to call the API (CORS; "*" for any); none: same-origin only
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("mode", f"unknown mode {self.mode!r}; use one of {MODES}")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions", f"must be ≥ 1, got {self.max_sessions}")
        if self.max_concurrent_turns < 1:
            raise ConfigError("max_concurrent_turns", f"must be ≥ 1, got {self.max_concurrent_turns}")
        if not self.pool_wait_s >= 0:  # NaN too
            raise ConfigError("pool_wait_s", f"must be ≥ 0 seconds, got {self.pool_wait_s}")
        if any(not key for key in self.api_keys):
            raise ConfigError("api_key", "must not be empty")
        bad = next((o for o in self.allowed_origins if o != "*" and "://" not in o), None)
        if bad is not None:
            raise ConfigError("allowed_origins", f"{bad!r} is not an origin; use scheme://host[:port] or *")


class StatelessSessions:
    """The router of ``mode="stateless"``: a fresh conversation per call, closed after it."""

    def __init__(self, make_conversation) -> None:
        self._make = make_conversation
        self.evicted = 0

    def route(self, turns: Sequence[Turn], session_id: str | None = None) -> Route:
        return Route(Session(self._make(uuid.uuid4().hex)), list(turns), "new")

    def done(self, session: Session, digests: Sequence[str]) -> None:
        session.conversation.close()

    def forget(self, session: Session) -> None:
        session.conversation.close()

    def sessions(self) -> list[Session]:
        return []

    def named(self, session_id: str) -> Session | None:
        return None

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return 0


class ChatService:
    def __init__(self, engine: Engine, config: ServerConfig, *, owns_engine: bool = False) -> None:
        self.engine = engine
        self.config = config
        self.owns_engine = owns_engine  # close() closes the engine too (spills the disk tier)
        self._routers: dict[str | None, SessionRouter | StatelessSessions] = {}
        self._lock = threading.Lock()
        self.metrics = ServerMetrics(engine.pool.stats, self.session_count)
        # each key's tenant name, derived once: it prefixes ids in the store, so it must
        # not give the key away (an unsalted SHA-256 of a short key is found by trying keys)
        self._key_tenants = {key: "key-" + _key_digest(key) for key in config.api_keys}
        self._check_settings()

    def _check_settings(self) -> None:
        """A setting every conversation would fail on fails the start, not each request
        (``ContextBudgetError``): a system block (``--tagging free``'s protocol prompt)
        that leaves ``--budget`` no room for a message. Checked on a conversation of its
        own, never stored."""
        if self.config.mode != "stateless" and self.config.budget is not None:
            Conversation(
                self.engine,
                tagging=self.config.tagging,
                budget=self.config.budget,
                generation=self.config.generation,
                use_pool=False,
            ).close()

    def tenant(self, api_key: str | None, user: str | None) -> str | None:
        """The tenant of a request whose key was already checked (see ``app.py``)."""
        if self.config.api_keys and api_key is not None:
            return self._key_tenants[api_key]  # checked: one of config.api_keys
        return f"user-{hashlib.sha256(user.encode()).hexdigest()[:16]}" if user else None

    def call(self, request: ChatRequest, tenant: str | None, cancelled: Callable[[], bool] | None = None) -> ChatCall:
        return ChatCall(self.router(tenant), self.engine, request, cancelled)

    def router(self, tenant: str | None) -> SessionRouter | StatelessSessions:
        with self._lock:
            router = self._routers.get(tenant)
            if router is None:
                make = lambda cid: self._conversation(cid, tenant)  # noqa: E731
                if self.config.mode == "stateless":
                    router = StatelessSessions(make)
                else:
                    namespace = f"{tenant}/" if tenant else ""
                    router = SessionRouter(make, self.config.max_sessions, namespace=namespace, pool=self.engine.pool)
                self._routers[tenant] = router
            return router

    def session_count(self) -> int:
        with self._lock:
            routers = list(self._routers.values())
        return sum(len(r) for r in routers)

    def session_summaries(self, tenant: str | None) -> list[dict[str, Any]]:
        return [summary(s.conversation) for s in self.router(tenant).sessions()]

    def session(self, tenant: str | None, session_id: str) -> Session | None:
        return self.router(tenant).listed(session_id)

    def close(self) -> None:
        with self._lock:
            routers = list(self._routers.values())
            self._routers.clear()
        for router in routers:
            router.close()
        if self.owns_engine:
            self.engine.close()

    def _conversation(self, conversation_id: str, tenant: str | None) -> Conversation:
        stateless = self.config.mode == "stateless"
        return Conversation(
            self.engine,
            conversation_id=conversation_id,
            tagging="rules" if stateless else self.config.tagging,
            budget=None if stateless else self.config.budget,
            k=self.config.k,
            compact_ahead=self.config.compact_ahead and not stateless,
            generation=self.config.generation,
            store=None if stateless else self.config.db,
            cache_salt=tenant,
            use_pool=not stateless,
        )


def summary(conversation: Conversation) -> dict[str, Any]:
    stats = conversation.stats()
    return {
        "id": conversation.id,
        "object": "clm.session",
        "messages": len(conversation.history),
        "turns": conversation.turn,  # a fork counts the turns of the history it shares, as its replies' clm.turn does
        "context_tokens": stats["context_tokens"],
        "hit_rate": stats["hit_rate"],
    }


def detail(conversation: Conversation) -> dict[str, Any]:
    """A session's context, segments and decisions, for ``GET /v1/sessions/{id}``."""
    last = conversation.last_reply
    return {
        **summary(conversation),
        "context": conversation.context,
        "segments": [
            {
                "id": s.id,
                "message": s.message_index,
                "role": s.role,
                "kind": s.kind,
                "status": s.status.value,
                "label": s.label.value,
                "pinned": s.pinned,
                "tokens": len(s.token_ids),
                "text": s.text,
                "summary": s.summary,
            }
            for s in conversation.segments
        ],
        "last_decisions": [d.as_dict() for d in last.decisions] if last is not None else [],
        "stats": conversation.stats(),
    }


_TENANT_SALT = b"clm-middleware tenant of an API key"
_TENANT_ROUNDS = 200_000  # PBKDF2 rounds: ~0.1 s a key here, paid once per key at start


def _key_digest(api_key: str) -> str:
    """16 hex characters naming ``api_key``'s tenant: PBKDF2-HMAC-SHA256, so trying
    candidate keys against ids read from a store costs 200,000 hashes each."""
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), _TENANT_SALT, _TENANT_ROUNDS).hex()[:16]
