"""HTTP to an OpenAI-compatible serving engine: JSON calls, streamed completions, retries.

Retries (tenacity) cover what a restart or a full queue looks like from outside: a
refused or timed-out connection, and ``503 Service Unavailable`` (vLLM and llama.cpp
answer it while loading or overloaded). They apply only before the first byte of a
response: once tokens have been streamed to the caller, a broken stream is an error,
never a silent second request (the caller would see tokens twice).

Every failure is a ``RemoteEngineError`` whose ``status`` says whose it is: 503 while
the engine cannot be reached or is overloaded, 400 when it refused the request as
invalid, 502 for anything else (an error answer, a broken or unreadable stream).

A stream read on behalf of a caller that can go away (``stream(..., cancelled=)``) is
opened and read in a thread of its own, and the caller's check is asked every
``CANCEL_POLL_S`` while the engine sends nothing, its headers included: a stalled engine
never holds a cancelled turn (an HTTP client that left) for the read timeout.
"""

from __future__ import annotations

import contextlib
import html
import json
import queue
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from clm_middleware.errors import ClmError, RemoteEngineError, TurnCancelled

RETRY_ATTEMPTS = 4  # ~0.25 + 0.5 + 1 s of waiting: a server restart, not an outage
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a long prompt's prefill on a CPU server sends nothing for minutes
# a JSON call (the model list, /props, /tokenize) a working server answers at once: one that
# accepts the connection and says nothing (hung, stopped, a proxy) is said within this, not
# after READ_TIMEOUT_S (clm serve's start-up had waited 10 minutes in silence)
JSON_TIMEOUT_S = 30.0
CANCEL_POLL_S = 0.25  # how often a waiting stream asks whether its caller went away
DRAIN_S = 1.0  # after [DONE], how long the stream's end may take before the connection is dropped
AGAIN = "the turn was undone and no message was lost; retry once the server is back"


class _Retryable(Exception):
    """A 503: worth another try."""

    def __init__(self, response_text: str) -> None:
        super().__init__(response_text)
        self.response_text = response_text


def _retryable(error: BaseException) -> bool:
    return isinstance(error, _Retryable | httpx.ConnectError | httpx.ConnectTimeout)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    base_url: str
    api_key: str | None = None
    retry_attempts: int = RETRY_ATTEMPTS
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S
    json_timeout_s: float = JSON_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ClmError(f"engine URL {self.base_url!r} must start with http:// or https://")
        if self.retry_attempts < 1:
            raise ClmError(f"retry_attempts must be ≥ 1, got {self.retry_attempts}")


class ServerClient:
    """One connection pool to one server; thread-safe (httpx.Client is)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        self._http = httpx.Client(base_url=config.base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def get_json(self, path: str, *, missing_ok: bool = False) -> Any:
        """GET ``path``; ``None`` for a 404/405 when ``missing_ok`` (an endpoint this server lacks)."""
        return self._call("GET", path, None, missing_ok)

    def post_json(self, path: str, body: dict[str, Any], *, missing_ok: bool = False) -> Any:
        return self._call("POST", path, body, missing_ok)

    def stream(
        self, path: str, body: dict[str, Any], *, cancelled: Callable[[], bool] | None = None
    ) -> Iterator[dict[str, Any]]:
        """POST ``body`` with ``stream: true``; yields each server-sent event's JSON.

        Closing the iterator closes the connection: the server sees the client leave
        and stops generating (vLLM aborts the request, llama.cpp frees the slot). With
        ``cancelled``, a wait for the next event ends with ``TurnCancelled`` (and the
        connection closed) within ``CANCEL_POLL_S`` of it saying yes.
        """

        def opened() -> httpx.Response:
            return self._retrying(lambda: self._open_stream(path, body))

        response = opened() if cancelled is None else None
        reader = None if cancelled is None else _ReaderThread(opened, cancelled)
        try:
            for line in reader.lines() if reader is not None else response.iter_lines():
                if not line.startswith("data:"):
                    continue  # comments, event names, keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    if reader is not None:
                        reader.drain(DRAIN_S)
                    return
                try:
                    event = json.loads(data)
                except ValueError as error:
                    raise RemoteEngineError(
                        f"{self._where(path)} sent an event that is not JSON: {data[:120]!r}", hint=AGAIN
                    ) from error
                if isinstance(event, dict) and "error" in event:
                    raise RemoteEngineError(f"{self._where(path)} reported an error mid-reply: {event['error']}")
                yield event
        except httpx.HTTPError as error:
            raise RemoteEngineError(
                f"{self._where(path)} broke off the reply ({type(error).__name__}: {error})", hint=AGAIN
            ) from error
        finally:
            if reader is not None:
                reader.close()
            else:
                response.close()

    # -------------------------------------------------------------- internal

    def _where(self, path: str) -> str:
        return f"the engine at {self.config.base_url.rstrip('/')}{path}"

    def _retrying(self, attempt, json_call: bool = False):
        """``attempt()`` with retries; its failure as a ``RemoteEngineError``. A JSON call
        that ran out of ``json_timeout_s`` says so (a stream's read timeout is a stall
        mid-request: a long prefill, or a server that went away)."""
        retrying = Retrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.config.retry_attempts),
            wait=wait_exponential(multiplier=0.25, max=2.0),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except _Retryable as error:
            raise RemoteEngineError(
                f"{self._where('')} is unavailable (503) after {self.config.retry_attempts} tries: "
                f"{error.response_text[:200]}",
                hint="the server is loading or overloaded; try again later",
                status=503,
            ) from error
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise RemoteEngineError(
                f"cannot reach {self._where('')} after {self.config.retry_attempts} tries ({error})",
                hint="check that the server runs and --engine names its address",
                status=503,
            ) from error
        except httpx.ReadTimeout as error:
            if not json_call:
                raise self._stalled(error) from error
            raise RemoteEngineError(
                f"{self._where('')} accepted the request but sent no answer within {self.config.json_timeout_s:g} s",
                hint="check that the server at --engine is a serving engine and is not hung or stopped",
            ) from error
        except httpx.HTTPError as error:  # the request went out; the server vanished or stalled before answering
            raise self._stalled(error) from error

    def _stalled(self, error: httpx.HTTPError) -> RemoteEngineError:
        return RemoteEngineError(
            f"{self._where('')} stopped answering mid-request ({type(error).__name__}: {error})", hint=AGAIN
        )

    def _call(self, method: str, path: str, body: dict[str, Any] | None, missing_ok: bool) -> Any:
        timeout = httpx.Timeout(self.config.json_timeout_s, connect=self.config.connect_timeout_s)

        def attempt() -> Any:
            response = self._http.request(method, path, json=body, timeout=timeout)
            if response.status_code == 503:
                raise _Retryable(response.text)
            if missing_ok and response.status_code in (404, 405, 501):
                return None
            self._check(path, response)
            return response.json()

        return self._retrying(attempt, json_call=True)

    def _open_stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        request = self._http.build_request("POST", path, json=body)
        response = self._http.send(request, stream=True)
        if response.status_code == 503:
            text = response.read().decode("utf-8", "replace")
            response.close()
            raise _Retryable(text)
        if response.status_code >= 400:
            response.read()
            response.close()
            self._check(path, response)
        return response

    def _check(self, path: str, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            detail: Any = response.json()
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
        except ValueError:
            detail = _readable(response.text)
            json_error = False
        else:
            json_error = True
        code = response.status_code
        hint = "check --engine-api-key" if code in (401, 403) else None
        # a path the server lacks; vLLM's JSON 404 names a model it does not serve instead
        if code in (405, 501) or (code == 404 and not json_error):
            hint = (
                f"this server does not serve {path}: --engine needs an OpenAI-compatible serving engine that "
                "takes token-id prompts there (vLLM, llama.cpp's llama-server)"
            )
        # the engine judged the request itself invalid (a prompt over its context, a
        # parameter out of its range): the caller's to fix; anything else is the engine's
        status = 400 if code in (400, 413, 422) else 502
        raise RemoteEngineError(f"{self._where(path)} answered {code}: {str(detail)[:300]}", hint=hint, status=status)


def _readable(text: str) -> str:
    """An error page's text without its markup (a web server's HTML page, not the
    300 characters of ``<!DOCTYPE HTML><html lang=...`` it opens with)."""
    if not _TAG.search(text):
        return text
    text = _HIDDEN.sub(" ", text)
    return " ".join(html.unescape(_TAG.sub(" ", text)).split())


_TAG = re.compile(r"<[a-zA-Z!/][^>]*>")
_HIDDEN = re.compile(r"<(head|script|style)\b.*?</\1\s*>", re.S | re.I)


class _ReaderThread:
    """The stream opened (headers awaited, retries included) and its lines read in a
    thread of its own, so that waiting for the engine, before its headers as after them,
    asks ``cancelled`` every ``CANCEL_POLL_S``, and after every line (a keep-alive comment
    too): ``TurnCancelled`` once it says yes.

    The reader's errors are raised in the caller's thread. ``finished``: the reader has
    ended; until then the response is the reader's, and only ``close`` may touch it. A
    stream closed before its headers came is abandoned: the thread closes the response
    as soon as it arrives (the engine then sees the client gone), so the caller never
    waits for it."""

    def __init__(self, open_stream: Callable[[], httpx.Response], cancelled: Callable[[], bool]) -> None:
        self._open, self._cancelled = open_stream, cancelled
        self._response: httpx.Response | None = None
        self._closed = False
        self._lock = threading.Lock()  # orders the response's arrival and the caller's close
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.finished = False
        threading.Thread(target=self._read, name="clm-remote-stream", daemon=True).start()

    def _read(self) -> None:
        try:
            response = self._open()
            with self._lock:
                if self._closed:  # the caller left while the engine had not answered
                    response.close()
                    return
                self._response = response
            for line in response.iter_lines():
                self._queue.put(("line", line))
        except BaseException as error:  # handed to the caller's thread
            self._queue.put(("error", error))
        else:
            self._queue.put(("end", None))

    def lines(self) -> Iterator[str]:
        while True:
            try:
                kind, value = self._queue.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                kind, value = "wait", None
            if kind in ("wait", "line") and self._asked():  # keep-alives say nothing either
                raise TurnCancelled("the turn was cancelled by its caller while the engine sent no reply")
            if kind == "wait":
                continue
            if kind != "line":
                self.finished = True
                if kind == "error":
                    raise value
                return
            yield value

    def _asked(self) -> bool:
        """The caller's check; before the engine answered the request, its ``waiting()``
        where it has one (a check that also tells its caller the engine admitted the
        request, ``server/streaming.TurnEvents``, must not say so while retries run)."""
        waiting = getattr(self._cancelled, "waiting", None)
        return waiting() if waiting is not None and self._response is None else self._cancelled()

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the reader to reach the stream's end (after
        ``[DONE]``), so that the connection goes back to the pool for the next request."""
        try:
            while not self.finished:
                kind, _ = self._queue.get(timeout=timeout_s)
                self.finished = kind != "line"
        except queue.Empty:
            return

    def close(self) -> None:
        """Let go of the stream: a reader still blocked on the socket is woken by shutting
        the socket down (closing a socket another thread reads does not wake it) and the
        connection is not reused; a response not yet come is closed when it comes."""
        with self._lock:
            self._closed = True
            response = self._response
        if response is None:
            return
        if not self.finished:
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):  # already closed by the server
                    sock.shutdown(socket.SHUT_RDWR)
        response.close()
