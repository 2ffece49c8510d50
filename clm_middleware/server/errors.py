"""Errors as OpenAI clients expect them: ``{"error": {"message", "type", "param", "code"}}``.

Every failure leaves the server as this JSON object with a fitting status; no traceback
ever does (an unexpected exception is logged here and answered with a 500 that says
only that). ``clm_error_to_api`` maps the library's errors:

- ``ConfigError`` → 400, ``param`` = the field it names;
- ``ContextWindowError`` / ``ContextBudgetError`` / ``PoolTooSmallError`` (more KV blocks
  than the whole pool has) → 400, ``code`` = ``context_length_exceeded``;
- ``PoolExhaustedError`` (running requests hold the room; idle conversations have already
  given theirs back) → 503 with ``Retry-After``;
- ``RemoteEngineError`` (the serving engine behind a remote engine) → its ``status``: 503
  with ``Retry-After`` while the engine is down or overloaded, 400 when it refused the
  request as invalid, 502 for anything else it did wrong;
- any other ``ClmError`` → 400 when it is the caller's to fix (a ``ValueError``), else 500.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clm_middleware.errors import (
    ClmError,
    ConfigError,
    ContextWindowError,
    PoolExhaustedError,
    PoolTooSmallError,
    RemoteEngineError,
)
from clm_middleware.lifecycle.compaction import ContextBudgetError

log = logging.getLogger("clm_middleware.server")

RETRY_AFTER_S = 1
# as OpenAI: a 401 (a wrong key) and a 404 (an unknown model, session or path) are
# invalid requests, told apart by their codes; a busy server is service_unavailable_error
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    503: "service_unavailable_error",
}


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        if self.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def clm_error_to_api(error: ClmError) -> APIError:
    if isinstance(error, ConfigError):
        return APIError(400, str(error), param=error.field)
    if isinstance(error, PoolTooSmallError):
        message = _for_a_client(error, "lower max_tokens or shorten the messages", POOL_FLAG)
        return APIError(400, message, param="messages", code="context_length_exceeded")
    if isinstance(error, ContextWindowError | ContextBudgetError):
        message = _for_a_client(error, "shorten the messages", "the server's --budget sets what a prompt may hold")
        return APIError(400, message, param="messages", code="context_length_exceeded")
    if isinstance(error, PoolExhaustedError):
        message = _for_a_client(error, "retry after Retry-After seconds", POOL_FLAG)
        return APIError(503, message, code="pool_exhausted", retry_after=RETRY_AFTER_S)
    if isinstance(error, RemoteEngineError):
        log.error("the serving engine failed a request: %s", error)
        code = {503: "engine_unavailable", 400: "engine_rejected"}.get(error.status, "engine_error")
        retry_after = RETRY_AFTER_S if error.status == 503 else None
        return APIError(error.status, str(error), code=code, retry_after=retry_after)
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    log.error("request failed: %s", error)
    return APIError(500, str(error), code="internal_error")


POOL_FLAG = "the server's --max-kv-bytes sizes the pool"


def _for_a_client(error: ClmError, what_to_do: str, server_flag: str) -> str:
    """An error's message in the request's terms: the library's ``max_new_tokens`` is the
    request's ``max_tokens``, and its hint (``max_kv_bytes``, ``budget=...``: Python
    arguments, the operator's) gives way to ``what_to_do`` for the client and the server's
    flag that decides it (a context-window error had told a client to "set a context
    budget (budget=...)")."""
    message = error.message.replace("max_new_tokens", "max_tokens")
    return f"{message} ({what_to_do}; {server_flag})"


def unexpected_error(error: BaseException) -> APIError:
    log.exception("unexpected error while serving a request", exc_info=error)
    return APIError(500, "the server hit an internal error; see its log", code="internal_error")


# how pydantic names the member of a union it tried, in an error's location: a plain type
# ("str"), a validator ("function-after"), or a parametrised one ("list[str]", "literal[...]")
_UNION_MEMBER = re.compile(r"str|int|float|bool|none|dict|list|function-(after|before|wrap|plain)|[\w-]+\[.*\]", re.S)


# the request's fields whose keys are the client's own (a value checked per key): after
# them a part is a key, however it reads ({"metadata": {"str": 5}} → metadata.str)
_KEYED_FIELDS = frozenset({"metadata", "logit_bias"})


def validation_param(location: tuple) -> str | None:
    """``("body", "messages", 3, "role")`` → ``messages[3].role``."""
    parts = [p for p in location if p != "body"]
    text = ""
    for index, part in enumerate(parts):
        if isinstance(part, int):
            text += f"[{part}]"
        elif _UNION_MEMBER.fullmatch(part) and not (index and parts[index - 1] in _KEYED_FIELDS):
            continue  # which member of a union pydantic tried: not a field
        else:
            text += f".{part}" if text else str(part)
    return text or None


_SHOULD_BE = "Input should be "


def union_message(problems: list[dict], first: dict) -> str:
    """``first``'s message, with those of the union members that failed beside it at the
    same place: ``"content": 5`` is "Input should be a valid string, or a valid list"
    (it had named only the string member, though a list of parts is taken too)."""
    location = tuple(first.get("loc", ()))
    said = [str(first.get("msg"))]
    for problem in problems:
        loc = tuple(problem.get("loc", ()))
        message = str(problem.get("msg"))
        if problem is first or len(loc) != len(location) or loc[:-1] != location[:-1] or message in said:
            continue
        if not (_UNION_MEMBER.fullmatch(str(loc[-1])) and _UNION_MEMBER.fullmatch(str(location[-1]))):
            continue
        said.append(message)
    return said[0] + "".join(", or " + m.removeprefix(_SHOULD_BE) for m in said[1:])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(ClmError)
    async def _clm_error(_: Request, error: ClmError) -> JSONResponse:
        return clm_error_to_api(error).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        # the deepest problem: of a union's failed members, the one that got furthest
        # ("content[0].type: Field required", not the str member's "a valid string")
        first = max(problems, key=lambda p: len(p.get("loc", ())), default={"loc": (), "msg": "invalid request body"})
        param = validation_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {first.get('msg')}").response()
        content_type = request.headers.get("content-type", "")
        if param is None and not await request.body():
            return APIError(400, "the request body is empty; send the request as a JSON object").response()
        if param is None and "json" not in content_type.lower():
            # FastAPI reads a body as JSON only when its Content-Type says so (curl -d sends a form type)
            sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            problem = f"the request body must be JSON with Content-Type: application/json; got {sent}"
            return APIError(400, problem).response()
        said = union_message(problems, first)
        message = f"{param}: {said}" if param else said
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        response = APIError(error.status_code, str(error.detail)).response()
        response.headers.update(error.headers or {})  # a 405's Allow (RFC 9110), as Starlette sends it
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        return unexpected_error(error).response()
