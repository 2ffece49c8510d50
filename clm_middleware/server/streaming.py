"""A turn streamed as server-sent events, generated in a worker thread.

``TurnEvents`` (a ``WorkerEvents``) runs the call in a thread and hands its events to the
loop: ``("started", None)`` once the engine admitted the request (its first prefill chunk
or token; a remote engine's answer to the request), ``("delta", text)``, then ``("done",
answer)`` or ``("error", exception)``. The request handler waits for the first event
before it answers (watching for the client to leave meanwhile), so a turn that fails at
admission (pool exhausted, context too long, a remote engine unreachable or refusing)
gets a real error status; later errors arrive as an ``error`` event. A client that goes
away sets ``cancelled``: the turn stops at its next token, or at its next prefill chunk
while it computes the prompt, is undone (``ChatCall``) and gives its blocks back, and the
response ends only after that.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from clm_middleware.adapters.chat_call import ChatAnswer, ChatCall
from clm_middleware.adapters.worker_events import Event, WorkerEvents
from clm_middleware.errors import ClmError

from . import convert
from .errors import clm_error_to_api, unexpected_error
from .service import ChatService


class TurnEvents(WorkerEvents):
    """Pass the object itself as the call's ``cancelled`` callback (called before every
    prefill chunk and after every token), then ``start_call(call)``. The first event is
    ``("started", None)`` once it is first called (the engine admitted the request), or
    the turn's ``done`` / ``error``. ``waiting()`` asks the same without claiming
    admission: a remote engine's client asks it while the engine has not answered the
    request yet (retries included), so an engine that cannot be reached or refuses the
    request is a real status for a stream too (it had been a 200 stream holding an error
    event whenever the failure took over 0.25 s: a helper's sweep)."""

    def __init__(self, on_finished: Callable[[], None] | None = None) -> None:
        super().__init__(on_finished)  # called once on the event loop when the turn is done or undone
        self._started = False

    def __call__(self) -> bool:
        if not self._started:
            self._started = True
            self.post("started", None)
        return self.cancelled.is_set()

    def waiting(self) -> bool:
        return self.cancelled.is_set()

    def start_call(self, call: ChatCall) -> None:
        def produce() -> None:
            for delta in call.stream():  # a cancelled turn raises TurnCancelled, undone
                self.post("delta", delta)
            self.post("done", call.answer)

        self.start(produce)


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
