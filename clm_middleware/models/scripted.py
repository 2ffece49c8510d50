"""Make any model say scripted token sequences: deterministic tests without a trained model.

``ScriptedReplies`` is a logits processor (see ``Engine(logits_processors=...)``): at
the first step of each generation it takes the next scripted reply, and at step
``i`` it leaves only token ``reply[i]`` possible. Everything else (pool, prefill,
KV, streaming, adapters) runs for real; a script that runs out lets the model's own
logits through. Concurrent generations each take their own reply (per-thread state).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

import torch


class ScriptedReplies:
    def __init__(self, replies: Iterable[Sequence[int]] = ()) -> None:
        self._queue: deque[list[int]] = deque(list(reply) for reply in replies)
        self._lock = threading.Lock()
        self._local = threading.local()  # the reply in progress, per generating thread
        self.started = 0  # generations that took a scripted reply

    def add(self, reply_ids: Sequence[int]) -> None:
        self._queue.append(list(reply_ids))

    @property
    def remaining(self) -> int:
        return len(self._queue)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not generated:
            with self._lock:
                self._local.current = self._queue.popleft() if self._queue else None
                self.started += self._local.current is not None
        current = getattr(self._local, "current", None)
        if current is None or len(generated) >= len(current):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[current[len(generated)]] = 0.0
        return forced
