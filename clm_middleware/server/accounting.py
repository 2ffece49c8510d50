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

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, unexpected_error
from .metrics import ServerMetrics


class RequestAccounting:
    """Counts each answered request once, at its response's start, under the route's
    template (one label per endpoint, not per URL); a ``Content-Length`` over
    ``max_body_bytes`` is a 413 before the body is read."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

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

        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            refusal = APIError(413, f"the request body is over {self.max_body_bytes} bytes", code="body_too_large")
            await refusal.response()(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception as error:
            if started:  # half a response is out: nothing to answer with but closing it
                raise
            await unexpected_error(error).response()(scope, receive, counting_send)

    def _count(self, scope: Scope, status: int) -> None:
        route: Any = scope.get("route")  # set by the router on the shared scope once it matched
        # the template without converters ("/v1/sessions/{session_id}", not "{session_id:path}")
        endpoint = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
