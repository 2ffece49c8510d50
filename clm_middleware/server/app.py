"""The HTTP surface of ``clm serve``: OpenAI chat completions over managed conversations.

Endpoints (docs/serve.md documents each): ``POST /v1/chat/completions``, ``GET
/v1/models``, ``GET /v1/sessions``, ``GET`` and ``DELETE /v1/sessions/{id}`` (delete
closes it: its blocks go back to the pool; with a store it resumes by name), ``GET
/health``, ``GET /metrics``. With API keys, every ``/v1`` route needs
``Authorization: Bearer KEY``.

Generation runs in worker threads, never on the event loop (streaming.py for streams).
A request the KV pool has no room for waits in line for running turns (pool_room.py).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clm_middleware.adapters.chat_call import ChatAnswer, ChatRequest
from clm_middleware.adapters.sessions import Session
from clm_middleware.errors import ClmError, PoolExhaustedError

from . import convert
from .accounting import RequestAccounting
from .errors import APIError, clm_error_to_api, install_error_handlers, unexpected_error
from .metrics import CONTENT_TYPE
from .pool_room import PoolRoom
from .schemas import ChatCompletionRequest
from .service import ChatService, detail, summary
from .streaming import Event, TurnEvents, sse

SESSION_HEADER = "x-session-id"
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: logged, never read
MAX_BODY_BYTES = 16 * 1024 * 1024


def create_app(service: ChatService, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()  # in-flight turns have finished (uvicorn drains them first)

    app = FastAPI(title="clm-middleware", lifespan=lifespan)
    # a turn is CPU- or GPU-bound: past a few at once they only slow each other down, so
    # more requests wait here (without blocking the event loop) for a free slot
    slots = asyncio.Semaphore(service.config.max_concurrent_turns)  # released by whoever ends the turn
    # requests the pool refused, waiting for a turn to end
    room = PoolRoom(service.config.pool_wait_s, on_line_change=service.metrics.waiting_for_pool.set)
    install_error_handlers(app)
    model_id = service.config.model_id
    created = int(time.time())

    # preflights answered here, also with no origin allowed (a refusal naming --allowed-origins,
    # not a 405); accounting, added after, counts them
    app.add_middleware(
        _CORSWithErrorObjects,
        allow_origins=list(service.config.allowed_origins),
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
    )
    app.add_middleware(
        RequestAccounting, metrics=service.metrics, max_body_bytes=max_body_bytes, routes=app.router.routes
    )

    def api_key(request: Request) -> str | None:
        keys = service.config.api_keys
        if not keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]  # no early exit
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")
        return token

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": model_id, "object": "model", "created": created, "owned_by": "clm-middleware"}

    @app.get("/v1/models")
    async def models(_: str | None = Depends(api_key)) -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, _: str | None = Depends(api_key)) -> dict[str, Any]:
        if name != model_id:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {model_id!r}", code="model_not_found"
            )
        return card

    def caller(request: Request, key: str | None = Depends(api_key)) -> str | None:
        """The tenant of a session request: the key's, or the ``user`` query parameter's."""
        return service.tenant(key, request.query_params.get("user"))

    def named_session(session_id: str, tenant: str | None = Depends(caller)) -> tuple[str | None, Session]:
        found = service.session(tenant, session_id)
        if found is None:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return tenant, found

    @app.get("/v1/sessions")
    async def sessions(tenant: str | None = Depends(caller)) -> dict[str, Any]:
        return {"object": "list", "data": service.session_summaries(tenant)}

    @app.get("/v1/sessions/{session_id:path}")
    async def session(named: tuple[str | None, Session] = Depends(named_session)) -> dict[str, Any]:
        _, found = named
        if found.busy:  # a turn is changing it right now: say so rather than read half of it
            return {**summary(found.conversation), "busy": True}
        return {**detail(found.conversation), "busy": False}

    @app.delete("/v1/sessions/{session_id:path}")
    async def close_session(
        session_id: str, named: tuple[str | None, Session] = Depends(named_session)
    ) -> dict[str, Any]:
        """A session name closes every branch made under it (the name then leads nowhere,
        and its next call starts afresh); a branch's own id closes that branch."""
        tenant, found = named
        router = service.router(tenant)
        closing = router.branches(session_id) or [found]
        if busy := next((s for s in closing if s.busy), None):
            raise APIError(409, f"session {busy.conversation.id!r} is answering a request", code="session_busy")
        for session in closing:
            router.forget(session)
        return {"id": session_id, "object": "clm.session", "deleted": True}

    async def start_turn(chat: ChatRequest, tenant: str | None) -> TurnEvents:
        """The turn running in a worker once a slot is free; the worker gives the slot back."""
        await slots.acquire()

        def finished() -> None:
            slots.release()
            room.turn_ended()

        room.turn_started()
        try:
            events = TurnEvents(on_finished=finished)
            events.start_call(service.call(chat, tenant, events))
        except BaseException:
            finished()
            raise
        return events

    async def admitted_turn(
        chat: ChatRequest, tenant: str | None, watch: _ClientWatch
    ) -> tuple[TurnEvents | None, Event | None]:
        """The turn and its first event; no event once the client left (the turn undone,
        or never started). A turn the pool refused while others run waits in line for one
        of them to end and tries again (pool_room.py), up to ``pool_wait_s`` from its
        arrival; then its last refusal stands."""
        deadline = time.monotonic() + room.wait_s
        ticket = room.join(tried=False) if room.waiting else None
        last: tuple[TurnEvents | None, Event | None] | None = None
        try:
            while True:
                if ticket is not None:
                    turn = await room.my_turn(ticket, deadline, watch.gone, DISCONNECT_POLL_S)
                    if turn == "gone":
                        return None, None
                    if turn == "timeout" and last is not None:
                        return last
                events = await start_turn(chat, tenant)
                first = await _next_unless_gone(events, watch)
                last = (events, first)
                refused = first is not None and first[0] == "error" and isinstance(first[1], PoolExhaustedError)
                if not refused or time.monotonic() >= deadline:
                    return last
                await events.finished()
                if room.running == 0:  # nothing runs: no room will come back
                    return last
                if ticket is None:
                    ticket = room.join(tried=True)
                else:
                    room.refused(ticket)
        finally:
            if ticket is not None:
                room.leave(ticket)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: str | None = Depends(api_key)):
        if body.model != model_id:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_id!r}",
                param="model",
                code="model_not_found",
            )
        session_id = _header_text(request.headers.get(SESSION_HEADER)) or (body.metadata or {}).get("session_id")
        chat = convert.chat_request(body, service.config.generation, session_id)
        tenant = service.tenant(key, body.user)
        completion_id = convert.completion_id()
        watch = _ClientWatch(request)
        events, first = await admitted_turn(chat, tenant, watch)
        if events is None or first is None:  # the client left before the first text; the turn was undone
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if first[0] == "error":  # failed before its first token: a real status, not a 200 stream
            await events.finished()
            error = first[1]
            raise clm_error_to_api(error) if isinstance(error, ClmError) else unexpected_error(error)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = sse(service, events, first, completion_id, model_id, session_id, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answer = first[1] if first[0] == "done" else await _answer_unless_gone(events, watch)
        if answer is None:  # nobody reads a response; the turn was undone
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        service.metrics.turn(answer.reply.stats)
        return JSONResponse(convert.completion_body(answer, model_id, completion_id, session_id))

    return app


class _CORSWithErrorObjects(CORSMiddleware):
    """Starlette's CORS middleware, but a refused preflight (an origin, method or header
    not allowed) answers an OpenAI-style error object, as every other error here does,
    instead of the plain text ``Disallowed CORS origin``."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        error = APIError(
            400,
            f"CORS preflight refused: {refused} not allowed (the server's --allowed-origins lists the origins)",
            param=refused.split(", ")[0],
            code="cors_not_allowed",
        )
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(error.body(), status_code=400, headers=headers)


class _ClientWatch:
    """Asks whether the request's client is still there, at most every ``DISCONNECT_POLL_S``
    however fast the turn's events come (asking on every token would cost a receive each)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.asked = time.monotonic()

    async def gone(self) -> bool:
        if time.monotonic() - self.asked < DISCONNECT_POLL_S:
            return False
        self.asked = time.monotonic()
        return await self.request.is_disconnected()


def _header_text(value: str | None) -> str | None:
    """A header value as the client wrote it: HTTP hands headers over as latin-1, and a
    client that sent UTF-8 (``X-Session-Id: ünï``, as httpx and the openai SDK do) had its
    session named ``Ã¼nÃ¯``, which the sessions API then could not find. Bytes that are
    not UTF-8 stay as latin-1 read them."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


async def _next_unless_gone(events: TurnEvents, watch: _ClientWatch) -> Event | None:
    """The turn's next event, or None once the client has gone away: then the turn is
    cancelled and undone (mid-prefill too) before this returns. The client is asked
    about every ``DISCONNECT_POLL_S`` whether events come or not."""
    while True:
        try:
            event = await asyncio.wait_for(events.next(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            event = None
        if event is not None and event[0] != "delta":
            return event  # the turn has ended: its answer is stored, nothing is left to undo
        if await watch.gone():
            await events.finished()
            return None
        if event is not None:
            return event


async def _answer_unless_gone(events: TurnEvents, watch: _ClientWatch) -> ChatAnswer | None:
    """The turn's answer (its error is raised), or None once the client has gone away:
    then the turn is cancelled and undone before this returns, as a stream's is."""
    while True:
        event = await _next_unless_gone(events, watch)
        if event is None:
            return None
        kind, value = event
        if kind == "done":
            return value
        if kind == "error":
            await events.finished()
            raise value
