"""HTTP to an OpenAI-compatible serving engine: JSON calls, streamed completions, retries.

Retries (tenacity) cover what a restart or a full queue looks like from outside: a
refused or timed-out connection, and ``503 Service Unavailable`` (vLLM and llama.cpp
answer it while loading or overloaded). They apply only before the first byte of a
response: once tokens have been streamed to the caller, a broken stream is an error,
never a silent second request (the caller would see tokens twice).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from clm_middleware.errors import ClmError

RETRY_ATTEMPTS = 4  # ~0.25 + 0.5 + 1 s of waiting: a server restart, not an outage
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a long prompt's prefill on a CPU server sends nothing for minutes


class RemoteEngineError(ClmError, RuntimeError):
    """The serving engine could not be reached, answered an error, or broke off a reply."""


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

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` with ``stream: true``; yields each server-sent event's JSON.

        Closing the iterator closes the connection: the server sees the client leave
        and stops generating (vLLM aborts the request, llama.cpp frees the slot).
        """
        response = self._retrying(lambda: self._open_stream(path, body))
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # comments, event names, keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    raise RemoteEngineError(f"{self._where(path)} reported an error mid-reply: {event['error']}")
                yield event
        except httpx.HTTPError as error:
            raise RemoteEngineError(
                f"{self._where(path)} broke off the reply ({type(error).__name__}: {error})",
                hint="the turn was undone and no message was lost; retry once the server is back",
            ) from error
        finally:
            response.close()

    # -------------------------------------------------------------- internal

    def _where(self, path: str) -> str:
        return f"the engine at {self.config.base_url.rstrip('/')}{path}"

    def _retrying(self, attempt):
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
            ) from error
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise RemoteEngineError(
                f"cannot reach {self._where('')} after {self.config.retry_attempts} tries ({error})",
                hint="check that the server runs and --engine names its address",
            ) from error
        except httpx.HTTPError as error:  # the request went out; the server vanished or stalled before answering
            raise RemoteEngineError(
                f"{self._where('')} stopped answering mid-request ({type(error).__name__}: {error})",
                hint="the turn was undone and no message was lost; retry once the server is back",
            ) from error

    def _call(self, method: str, path: str, body: dict[str, Any] | None, missing_ok: bool) -> Any:
        def attempt() -> Any:
            response = self._http.request(method, path, json=body)
            if response.status_code == 503:
                raise _Retryable(response.text)
            if missing_ok and response.status_code in (404, 405, 501):
                return None
            self._check(path, response)
            return response.json()

        return self._retrying(attempt)

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
            detail = response.text
        hint = "check --engine-api-key" if response.status_code in (401, 403) else None
        raise RemoteEngineError(f"{self._where(path)} answered {response.status_code}: {str(detail)[:300]}", hint=hint)
