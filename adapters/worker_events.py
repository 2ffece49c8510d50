"""A blocking producer in a worker thread, read from the event loop: how an async caller
runs a turn (which blocks on the model) and can still leave it.

``start(produce)`` runs ``produce`` in the loop's executor; what it ``post``s reaches
``next()`` in order, and an exception it raises arrives as ``("error", exception)``.
``finished()`` sets ``cancelled`` (a turn asks it at every token and prefill chunk and
is undone) and waits until the worker is done, so a caller that leaves never races the
turn it left. ``on_finished`` runs once on the loop when the worker ends, however.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

Event = tuple[str, Any]


class WorkerEvents:
    def __init__(self, on_finished: Callable[[], None] | None = None) -> None:
        self.cancelled = threading.Event()
        self._on_finished = on_finished
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._worker: asyncio.Future | None = None

    def start(self, produce: Callable[[], None]) -> None:
        def run() -> None:
            try:
                produce()
            except BaseException as error:  # handed to the event loop, which answers it
                self.post("error", error)
            finally:  # the worker ends the work: a reader that never started still releases
                if self._on_finished is not None:
                    with contextlib.suppress(RuntimeError):
                        self._loop.call_soon_threadsafe(self._on_finished)

        self._worker = self._loop.run_in_executor(None, run)

    def post(self, kind: str, value: Any) -> None:
        """From the worker: hand ``(kind, value)`` to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutting down): nobody listens
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))

    async def next(self) -> Event:
        return await self._queue.get()

    @property
    def done(self) -> bool:
        return self._worker is None or self._worker.done()

    async def finished(self) -> None:
        """Stop the work if it still runs, and wait until it is done or undone."""
        self.cancelled.set()
        if self._worker is not None:
            await asyncio.shield(self._worker)
