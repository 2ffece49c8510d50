"""One error family for the whole library.

Every error carries the context a user needs to act (a path, a line, a field, a
segment) and, where there is one, the next step. The CLI prints ``str(error)`` as
one line and exits non-zero; it never shows a traceback for a ``ClmError``.

Kinds follow vLLM's split: a ``ValueError`` subclass is something the caller can
fix by changing its input; a ``RuntimeError`` subclass is a state the library
cannot continue from (pool exhausted, model missing).
"""

from __future__ import annotations


class ClmError(Exception):
    """Base of every error raised on purpose by clm-middleware."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} ({self.hint})"
        return self.message


class ConfigError(ClmError, ValueError):
    """A setting is out of range or inconsistent; names the field."""

    def __init__(self, field: str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{field}: {problem}", hint=hint)
        self.field = field
        self.problem = problem  # the message without the field it names


class ModelNotFoundError(ClmError, RuntimeError):
    """The named model (or the default model package) is not on this machine."""


class UnsupportedModelError(ClmError, ValueError):
    """The model's architecture does not fit the block pool (e.g. sliding window)."""


class ContextWindowError(ClmError, ValueError):
    """A request needs more positions than the model has."""


class ConversationBusyError(ClmError, RuntimeError):
    """A call on a conversation while another thread's call on it runs: a conversation
    answers one call at a time (its messages and context are one sequence)."""


class ContextBudgetError(ClmError, ValueError):
    """The newest turn alone does not fit the context budget."""


class StoreError(ClmError, RuntimeError):
    """The store cannot be opened or read."""


class ConversationExistsError(StoreError):
    """A new conversation was given the id of one the store already holds."""


class PoolExhaustedError(ClmError, RuntimeError):
    """The active requests need more KV blocks than the pool holds.

    Raised at admission, before any computation, so nothing is half-written.
    """


class PoolTooSmallError(PoolExhaustedError, ValueError):
    """One request needs more KV blocks than the whole pool has: no wait makes it fit
    (a caller's to fix, unlike a busy pool)."""


class TranscriptError(ClmError, ValueError):
    """A transcript file is malformed; names ``path:line`` and what was expected."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


class ChatTemplateError(ClmError, ValueError):
    """The tokenizer's chat template cannot be rendered append-only."""


class RemoteEngineError(ClmError, RuntimeError):
    """The serving engine behind a ``RemoteEngine`` could not be reached, answered an
    error, or broke off a reply. ``status`` is what an HTTP front end answers for it: 503
    while the engine is down or overloaded (worth a retry), 400 when it refused the request
    as invalid, 502 for anything else it did wrong."""

    def __init__(self, message: str, *, hint: str | None = None, status: int = 502) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class TurnCancelled(ClmError, RuntimeError):
    """The caller cancelled a turn while it was generating (a client went away); the
    turn was undone and its blocks given back."""
