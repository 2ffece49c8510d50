"""Every HTTP request counted by endpoint and status, bodies over the limit refused, and
an unexpected error answered here.

An exception no handler maps (a bug) is answered with the 500 of ``unexpected_error``
inside this middleware, so it is counted like any other status and the connection stays
usable: left to Starlette's outermost ``ServerErrorMiddleware``, the 500 went out
uncounted and the exception was re-raised, and uvicorn then reset the keep-alive
connection under the client's next request.

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's
``BaseHTTPMiddleware`` hides the client's ``http.disconnect`` from the endpoint, so a
non-streaming request could never tell that its caller had gone and would run its turn to
the end. Here ``receive`` passes through untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, unexpected_error
from .metrics import ServerMetrics


class _BodyTooLarge(BaseException):
    """A body without a ``Content-Length`` (chunked) went past the limit while read. A
    ``BaseException``: FastAPI answers any ``Exception`` raised while it reads a body
    with its own 400, which would hide the 413."""


class RequestAccounting:
    """Counts each answered request once, at its response's start, under the route's
    template (one label per endpoint, not per URL); a body over ``max_body_bytes`` is a
    413: before it is read when its ``Content-Length`` says so, else (chunked transfer)
    as soon as the bytes read pass the limit, so no body is ever held whole beyond it."""

    def __init__(
        self, app: ASGIApp, *, metrics: ServerMetrics, max_body_bytes: int, routes: Sequence[BaseRoute] = ()
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.routes = routes  # the app's, to name the endpoint of a request refused before routing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._count(scope, message["status"])
            await send(message)

        refusal = APIError(413, f"the request body is over {self.max_body_bytes} bytes", code="body_too_large")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await refusal.response()(scope, receive, counting_send)
            return
        read = 0

        async def bounded_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, bounded_receive, counting_send)
        except (Exception, _BodyTooLarge) as error:
            if started:  # half a response is out: nothing to answer with but closing it
                raise
            answer = refusal if isinstance(error, _BodyTooLarge) else unexpected_error(error)
            await answer.response()(scope, receive, counting_send)

    def _count(self, scope: Scope, status: int) -> None:
        route: Any = scope.get("route")  # set by the router on the shared scope once it matched
        if route is None:  # answered before routing: a body over the limit by its Content-Length,
            # a CORS preflight (OPTIONS, which no route takes: its path matches only partly)
            matched = [(r.matches(scope)[0], r) for r in self.routes]
            route = next((r for m, r in matched if m is Match.FULL), None) or next(
                (r for m, r in matched if m is Match.PARTIAL), None
            )
        # the template without converters ("/v1/sessions/{session_id}", not "{session_id:path}")
        endpoint = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
