"""A turn streamed as server-sent events, generated in a worker thread.

``TurnEvents`` runs the call in a thread and hands its events to the event loop:
``("started", None)`` once the engine admitted the request (its first prefill chunk or
token), ``("delta", text)``, then ``("done", answer)`` or ``("error", exception)``. The
request handler waits for the first event before it answers (watching for the client to
leave meanwhile), so a turn that fails at admission (pool exhausted, context too long)
gets a real error status; later errors arrive as an ``error`` event. A client that goes
away sets ``cancelled``: the turn stops at its next token, or at its next prefill chunk
while it computes the prompt, is undone (``ChatCall``) and gives its blocks back, and the
response ends only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from clm_middleware.adapters.chat_call import ChatAnswer, ChatCall
from clm_middleware.errors import ClmError

from . import convert
from .errors import clm_error_to_api, unexpected_error
from .service import ChatService

Event = tuple[str, Any]


class TurnEvents:
    """Pass ``tick`` as the call's ``cancelled`` callback (asked before every prefill chunk
    and after every token), then ``start(call)``. The first event is ``("started", None)``
    once it is first asked (the engine admitted the request), or the turn's ``done`` /
    ``error``."""

    def __init__(self, on_finished: Callable[[], None] | None = None) -> None:
        self.cancelled = threading.Event()
        self._on_finished = on_finished  # called once on the event loop when the turn is done or undone
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._started = False
        self._call: ChatCall | None = None
        self._worker: asyncio.Future | None = None

    def tick(self) -> bool:
        if not self._started:
            self._started = True
            self._post("started", None)
        return self.cancelled.is_set()

    def start(self, call: ChatCall) -> None:
        self._call = call
        self._worker = self._loop.run_in_executor(None, self._produce)

    async def next(self) -> Event:
        return await self._queue.get()

    async def finished(self) -> None:
        """Stop the turn if it still runs, and wait until it is done or undone."""
        self.cancelled.set()
        if self._worker is not None:
            await asyncio.shield(self._worker)

    def _post(self, kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutting down): nobody listens
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))

    def _produce(self) -> None:
        assert self._call is not None
        try:
            for delta in self._call.stream():  # a cancelled turn raises TurnCancelled, undone
                self._post("delta", delta)
            self._post("done", self._call.answer)
        except BaseException as error:  # handed to the event loop, which answers it
            self._post("error", error)
        finally:  # the worker, not the response, ends the turn: a stream never started still releases
            if self._on_finished is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._on_finished)


async def sse(
    service: ChatService,
    events: TurnEvents,
    first: Event,
    completion_id: str,
    model: str,
    session_id: str | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    """A role chunk, content deltas, the tool calls, a finish chunk carrying the ``clm``
    object, the usage chunk if asked, ``[DONE]``."""
    created = int(time.time())
    try:
        yield _data(convert.chunk(completion_id, created, model, {"role": "assistant", "content": ""}))
        kind, value = first
        if kind == "started":
            kind, value = await events.next()
        while kind == "delta":
            yield _data(convert.chunk(completion_id, created, model, {"content": value}))
            kind, value = await events.next()
        if kind == "error":
            api = clm_error_to_api(value) if isinstance(value, ClmError) else unexpected_error(value)
            yield _data(api.body())
        else:
            answer: ChatAnswer = value
            service.metrics.turn(answer.reply.stats)
            if answer.tool_calls:
                calls = [{"index": i, **c} for i, c in enumerate(convert.tool_calls(answer))]
                yield _data(convert.chunk(completion_id, created, model, {"tool_calls": calls}))
            final = convert.chunk(completion_id, created, model, {}, answer.finish_reason)
            final["clm"] = convert.extension(answer, session_id)
            yield _data(final)
            if include_usage:
                yield _data(
                    {**convert.chunk(completion_id, created, model, {}), "choices": [], "usage": convert.usage(answer)}
                )
        yield "data: [DONE]\n\n"
    finally:
        await events.finished()


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
