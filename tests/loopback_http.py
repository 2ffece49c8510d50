"""A plain HTTP server on 127.0.0.1 and a free port, answering as a test says, for the
remote engine's client to meet servers that misbehave on purpose."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

Answer = Callable[[http.server.BaseHTTPRequestHandler], None]


class LoopbackServer:
    """Serves while entered: each GET is answered by ``on_get(handler)``, each POST (its
    body read first) by ``on_post(handler)``; a method without an answer gets 501.
    Handler threads are daemons, so a stalled answer never blocks the test's exit."""

    def __init__(self, *, on_get: Answer | None = None, on_post: Answer | None = None) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer(on_get)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(on_post)

            def _answer(self, answer: Answer | None) -> None:
                if answer is None:
                    self.send_error(501)
                else:
                    answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def send(handler: http.server.BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    """Answer with ``status`` and ``body`` (a Content-Length response, connection kept)."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
