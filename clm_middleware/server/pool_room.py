"""A line for requests the KV pool has no room for while other turns run.

The pool refuses a request at admission (``PoolExhaustedError``) when the turns running
at the same time hold the room it needs. Answering that with a 503 at once let a client
that retried compete with every new request, so under sustained pressure one client
could be refused again and again while others were served (a sweep: 4 clients on a
60-block pool, one refused 8 times in a row). Here a refused request waits instead, in
arrival order, for a running turn to end, and tries again; only a request still refused
after ``wait_s`` (or refused while nothing runs, when no room will come back) is
answered 503. vLLM's scheduler and llama.cpp's server queue requests the same way.

Invariants (all on the event loop, no lock needed):
- Only the first request in line tries again; a request arriving while the line is not
  empty joins its end before its first try, so nobody overtakes a waiting request.
- The first in line tries again after each turn that ends (at once if it has not tried
  yet), never twice for the same end: a refusal costs no computation (admission comes
  before any prefill), but a loop of them would spin.
- A request leaves the line when it is admitted, answered 503, or its client goes away;
  leaving wakes the next in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable


class PoolRoom:
    """Turn counts and the line of requests waiting for pool room (see the module docstring)."""

    def __init__(self, wait_s: float, on_line_change: Callable[[int], None] | None = None) -> None:
        self.wait_s = wait_s
        self._on_line_change = on_line_change  # called with the line's length after each join and leave
        self.running = 0  # turns admitted or being admitted, not yet ended
        self._ended = 0  # turns ended so far: a waiter tries again once this has moved
        self._line: deque[_Ticket] = deque()
        self._changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def turn_started(self) -> None:
        self.running += 1

    def turn_ended(self) -> None:
        self.running -= 1
        self._ended += 1
        self._wake()

    def join(self, tried: bool) -> _Ticket:
        """A place at the end of the line; ``tried``: the request was refused just now
        (it tries again after the next turn ends), else it tries once it is first."""
        ticket = _Ticket(self._ended if tried else None)
        self._line.append(ticket)
        self._line_changed()
        return ticket

    def leave(self, ticket: _Ticket) -> None:
        if ticket in self._line:
            first = self._line[0] is ticket
            self._line.remove(ticket)
            self._line_changed()
            if first:
                self._wake()

    def refused(self, ticket: _Ticket) -> None:
        """The first in line was refused again: it waits for the next turn to end."""
        ticket.tried_at = self._ended

    async def my_turn(
        self, ticket: _Ticket, deadline: float, gone: Callable[[], Awaitable[bool]], poll_s: float
    ) -> str:
        """Wait until ``ticket`` may try: ``"try"``; ``"timeout"`` past ``deadline``
        (``time.monotonic()``); ``"gone"`` once ``gone()`` says the client left (asked
        every ``poll_s``)."""
        while True:
            first = bool(self._line) and self._line[0] is ticket
            if first and (ticket.tried_at is None or ticket.tried_at != self._ended):
                return "try"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError before Python 3.11
                await asyncio.wait_for(self._changed.wait(), min(left, poll_s))
            if await gone():
                return "gone"

    def _line_changed(self) -> None:
        if self._on_line_change is not None:
            self._on_line_change(len(self._line))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _Ticket:
    __slots__ = ("tried_at",)

    def __init__(self, tried_at: int | None) -> None:
        self.tried_at = tried_at  # the ended-turns count at its last refusal; None: not tried in line
