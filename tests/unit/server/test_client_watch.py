"""A non-streaming request notices its client left while tokens keep coming (server/app.py)."""

from __future__ import annotations

import asyncio
import time

from clm_middleware.server import app


class _FastTurn:
    """A turn's events: a token every 10 ms for ``seconds``, then its answer."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds
        self.stopped = False

    async def next(self):
        await asyncio.sleep(0.01)
        return ("done", "answer") if time.monotonic() > self.until else ("delta", "a")

    async def finished(self) -> None:
        self.stopped = True


class _Request:
    def __init__(self, gone: bool) -> None:
        self.gone, self.asked = gone, 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.gone


def test_a_client_that_left_is_noticed_while_tokens_stream_faster_than_the_poll():
    turn, request = _FastTurn(seconds=30.0), _Request(gone=True)
    started = time.monotonic()
    answer = asyncio.run(app._answer_unless_gone(turn, app._ClientWatch(request)))
    assert answer is None and turn.stopped
    assert time.monotonic() - started < 5 * app.DISCONNECT_POLL_S


def test_a_present_client_is_asked_about_every_poll_interval_not_per_token():
    turn, request = _FastTurn(seconds=1.0), _Request(gone=False)
    assert asyncio.run(app._answer_unless_gone(turn, app._ClientWatch(request))) == "answer"
    assert not turn.stopped and 1 <= request.asked <= 1.0 / app.DISCONNECT_POLL_S + 1
