"""The remote engine's HTTP client against a loopback server that misbehaves on purpose:
which status each failure carries, a stream that is not JSON, and a stalled stream whose
caller goes away (remote/client.py)."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time

import pytest
from loopback_http import LoopbackServer, send

from clm_middleware.errors import RemoteEngineError, TurnCancelled
from clm_middleware.remote.client import ClientConfig, ServerClient
from clm_middleware.server.errors import clm_error_to_api

EVENT = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'


def _answer(status: int, body: bytes, content_type: str = "application/json"):
    return lambda handler: send(handler, status, body, content_type)


class _Stream:
    """Send ``chunks`` as an event stream, then stay silent for ``stall_s`` (until the
    client hangs up, which sets ``hung_up``) before ending it."""

    def __init__(self, chunks: list[bytes], stall_s: float = 0.0) -> None:
        self.chunks, self.stall_s = chunks, stall_s
        self.hung_up = threading.Event()

    def __call__(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for chunk in self.chunks:
            handler.wfile.write(chunk)
            handler.wfile.flush()
        deadline = time.monotonic() + self.stall_s
        while time.monotonic() < deadline:
            try:  # a client that hung up makes a write fail, sooner or later
                handler.wfile.write(b": keep waiting\n\n")
                handler.wfile.flush()
            except OSError:
                self.hung_up.set()
                return
            time.sleep(0.1)


def _client(engine: LoopbackServer) -> ServerClient:
    return ServerClient(ClientConfig(engine.url, retry_attempts=1, read_timeout_s=30.0))


@pytest.mark.parametrize(
    ("engine_status", "status", "code"),
    [(500, 502, "engine_error"), (400, 400, "engine_rejected"), (503, 503, "engine_unavailable")],
)
def test_an_engine_error_answer_carries_whose_it_is_to_the_http_front(engine_status, status, code):
    body = b'{"error": {"message": "something went wrong there"}}'
    with LoopbackServer(on_post=_answer(engine_status, body)) as engine:
        client = _client(engine)
        with pytest.raises(RemoteEngineError, match="something went wrong there") as raised:
            list(client.stream("/v1/completions", {"prompt": [1]}))
        client.close()
    assert raised.value.status == status
    api = clm_error_to_api(raised.value)
    assert (api.status, api.code) == (status, code)
    assert (api.retry_after is not None) == (status == 503)


def test_an_html_error_page_is_a_502_naming_the_engine_with_the_pages_text_not_its_markup():
    page = b"<!DOCTYPE html><html><head><title>x</title></head><body><h1>Bad things</h1> &amp; more</body></html>"
    with LoopbackServer(on_post=_answer(500, page, "text/html")) as engine:
        client = _client(engine)
        with pytest.raises(RemoteEngineError, match=r"answered 500: Bad things & more$") as raised:
            client.post_json("/v1/completions", {})
        client.close()
    assert raised.value.status == 502


def test_a_server_without_the_completions_endpoint_is_named_as_such():
    """A static file server answers POST with a 501 page: its 300 characters of HTML were
    the whole message (a helper's probe with a chat-only address)."""
    with LoopbackServer() as engine:  # answers every method with http.server's 501 page
        client = _client(engine)
        with pytest.raises(RemoteEngineError, match="answered 501: Error response") as raised:
            next(client.stream("/v1/completions", {"prompt": [1]}))
        client.close()
    assert "<" not in str(raised.value)
    assert "does not serve /v1/completions" in (raised.value.hint or "")


def test_a_json_call_to_a_server_that_never_answers_fails_within_its_own_timeout():
    """clm serve's start-up asked a hung engine for its model list and waited the 600 s read
    timeout in silence (a helper's probe)."""
    with LoopbackServer(on_get=_Silent(stall_s=10.0)) as engine:
        client = ServerClient(ClientConfig(engine.url, retry_attempts=1, json_timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(RemoteEngineError, match=r"sent no answer within 0\.5 s") as raised:
            client.get_json("/v1/models")
        assert time.monotonic() - started < 5.0
        client.close()
    assert engine.url in str(raised.value) and "hung" in (raised.value.hint or "")


def test_a_completion_that_waits_past_its_read_timeout_is_a_stall_that_undid_the_turn():
    """A long prefill on a CPU server: not the start-up's "sent no answer" (a review)."""
    with LoopbackServer(on_post=_Silent(stall_s=10.0)) as engine:
        client = ServerClient(ClientConfig(engine.url, retry_attempts=1, read_timeout_s=0.5))
        with pytest.raises(RemoteEngineError, match="stopped answering mid-request") as raised:
            next(client.stream("/v1/completions", {"prompt": [1]}))
        client.close()
    assert "no message was lost" in (raised.value.hint or "")


def test_a_json_404_naming_a_model_is_not_taken_for_a_missing_path():
    """vLLM answers a model name it does not serve with a JSON 404 (a review)."""
    body = b'{"error": {"message": "The model `wrong-name` does not exist.", "code": 404}}'
    with LoopbackServer(on_post=_answer(404, body)) as engine:
        client = _client(engine)
        with pytest.raises(RemoteEngineError, match="answered 404: The model `wrong-name` does not exist") as raised:
            client.post_json("/v1/completions", {})
        client.close()
    assert raised.value.hint is None


def test_an_event_that_is_not_json_is_a_remote_engine_error_not_a_crash():
    with LoopbackServer(on_post=_Stream([EVENT, b"data: {not json\n\n"])) as engine:
        client = _client(engine)
        events = client.stream("/v1/completions", {"prompt": [1]})
        assert next(events)["choices"][0]["text"] == "a"
        with pytest.raises(RemoteEngineError, match="not JSON") as raised:
            next(events)
        client.close()
    assert raised.value.status == 502


def test_a_stalled_stream_ends_soon_after_its_caller_goes_away_and_hangs_up_on_the_engine():
    gone = threading.Event()
    stalled = _Stream([EVENT], stall_s=20.0)
    with LoopbackServer(on_post=stalled) as engine:
        client = _client(engine)
        events = client.stream("/v1/completions", {"prompt": [1]}, cancelled=gone.is_set)
        assert next(events)["choices"][0]["text"] == "a"
        threading.Timer(0.3, gone.set).start()
        started = time.monotonic()
        with pytest.raises(TurnCancelled):
            next(events)  # the engine sends nothing more: only the cancellation ends the wait
        assert time.monotonic() - started < 5.0
        assert stalled.hung_up.wait(timeout=5.0)
        client.close()


class _Silent:
    """Accept the request and answer nothing (no status line, no headers) for ``stall_s``:
    a hung engine, or a proxy in front of one."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    def __call__(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(self.stall_s)
        with contextlib.suppress(OSError):  # the client may be gone
            send(handler, 200, EVENT, "text/event-stream")


def test_a_stream_whose_engine_never_sends_headers_ends_soon_after_its_caller_goes_away():
    gone = threading.Event()
    silent = _Silent(stall_s=4.0)
    with LoopbackServer(on_post=silent) as engine:
        client = _client(engine)
        events = client.stream("/v1/completions", {"prompt": [1]}, cancelled=gone.is_set)
        threading.Timer(0.3, gone.set).start()
        started = time.monotonic()
        with pytest.raises(TurnCancelled):
            next(events)  # before this fix the wait for headers ignored the caller: 4 s
        assert time.monotonic() - started < 2.0
        events.close()
        client.close()


def test_a_cancellable_stream_that_ends_normally_yields_every_event():
    done = b'data: {"choices": [{"text": "b", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    with LoopbackServer(on_post=_Stream([EVENT, done])) as engine:
        client = _client(engine)
        texts = [e["choices"][0]["text"] for e in client.stream("/v1/completions", {}, cancelled=lambda: False)]
        client.close()
    assert texts == ["a", "b"]


class _Check:
    """A caller's check with ``waiting()``, as clm serve's stream passes: counts which was asked."""

    def __init__(self) -> None:
        self.admitted = self.waited = 0

    def __call__(self) -> bool:
        self.admitted += 1
        return False

    def waiting(self) -> bool:
        self.waited += 1
        return False


class _LateRefusal:
    """Answer ``status`` after ``delay_s`` with no headers before: an engine at work on a
    request it then refuses, or the client's retries."""

    def __init__(self, status: int, delay_s: float) -> None:
        self.status, self.delay_s = status, delay_s

    def __call__(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(self.delay_s)
        send(handler, self.status, b'{"error": {"message": "no room"}}', "application/json")


def test_until_the_engine_answers_a_stream_asks_the_callers_waiting_check_not_its_admission():
    """clm serve's stream took the first check as the engine's admission: a refusal that
    came after 0.25 s was a 200 stream holding an error event (a helper's sweep)."""
    check = _Check()
    with LoopbackServer(on_post=_LateRefusal(503, 1.0)) as engine:
        client = _client(engine)
        with pytest.raises(RemoteEngineError) as refused:
            next(client.stream("/v1/completions", {"prompt": [1]}, cancelled=check))
        client.close()
    assert clm_error_to_api(refused.value).status == 503
    assert check.waited >= 2 and check.admitted == 0
    check = _Check()
    done = b'data: {"choices": [{"text": "b", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    with LoopbackServer(on_post=_Stream([EVENT, done])) as engine:
        client = _client(engine)
        assert [e["choices"][0]["text"] for e in client.stream("/v1/completions", {}, cancelled=check)] == ["a", "b"]
        client.close()
    assert check.admitted >= 1  # once the engine answered, every check is its caller's admission check
