"""Make any model say scripted token sequences: deterministic tests without a trained model.

``ScriptedReplies`` is a logits processor (see ``Engine(logits_processors=...)``): at
the first step of each generation it takes the next scripted reply, and at step
``i`` it leaves only token ``reply[i]`` possible. Everything else (pool, prefill,
KV, streaming, adapters) runs for real; a script that runs out lets the model's own
logits through. Concurrent generations each take their own reply.
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
        # the reply in progress, per generation: keyed by the generation's own token list,
        # since one generation may be advanced from several threads (async executors)
        self._current: dict[int, list[int]] = {}
        self.started = 0  # generations that took a scripted reply

    def add(self, reply_ids: Sequence[int]) -> None:
        self._queue.append(list(reply_ids))

    @property
    def remaining(self) -> int:
        return len(self._queue)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        key = id(generated)
        with self._lock:
            if not generated:
                self._current.pop(key, None)
                if self._queue:
                    self._current[key] = self._queue.popleft()
                    self.started += 1
            current = self._current.get(key)
            if current is not None and len(generated) >= len(current) - 1:
                del self._current[key]  # its last token is chosen now
        if current is None or len(generated) >= len(current):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[current[len(generated)]] = 0.0
        return forced
