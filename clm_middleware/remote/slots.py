"""A stable llama.cpp slot per conversation, without knowing conversations.

llama.cpp keeps one cached prompt per slot, so a conversation's prefix hits only if
its next request goes to the slot that served its last one. We send ``id_slot``
explicitly: the slot whose last prompt + reply shares the longest prefix with the
new prompt (that is the conversation's own slot: its next prompt starts with all of
it); see ``SlotTable._choose`` for the order when none does.
The engine need not be told which conversation a call belongs to, and a plain
(stateless) client gets the same treatment.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Slot:
    tokens: list[int] = field(default_factory=list)
    last_used: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotTable:
    """Thread-safe; ``num_slots == 0`` means the server has no slots to pick (``pick`` returns None)."""

    def __init__(self, num_slots: int) -> None:
        self._slots = [_Slot() for _ in range(max(0, num_slots))]
        self._clock = 0
        self._lock = threading.Lock()

    def pick(self, prompt: Sequence[int]) -> int | None:
        if not self._slots:
            return None
        with self._lock:
            self._clock += 1
            best = self._choose(prompt)
            self._slots[best].last_used = self._clock
            self._slots[best].tokens = list(prompt)  # claimed now, so a concurrent pick sees it
            return best

    def _choose(self, prompt: Sequence[int]) -> int:
        """1. a slot whose whole content starts the prompt (the longest: the conversation's
        own slot, no lifecycle change); 2. a slot the prompt reuses at least half of (its
        own after a late change: a dropped reply, a compaction near the end); 3. an empty
        slot (a new conversation does not evict one it merely shares a system prompt
        with); 4. the slot whose content the prompt reuses the largest share of, the least
        recently used on a tie."""
        indices = range(len(self._slots))
        shared = [common_prefix(slot.tokens, prompt) for slot in self._slots]
        extended = [i for i in indices if self._slots[i].tokens and shared[i] == len(self._slots[i].tokens)]
        if extended:
            return max(extended, key=lambda i: shared[i])
        used = [i for i in indices if self._slots[i].tokens]
        best = max(
            used, key=lambda i: (shared[i] / len(self._slots[i].tokens), -self._slots[i].last_used), default=None
        )
        if best is not None and 2 * shared[best] >= len(self._slots[best].tokens):
            return best
        empty = [i for i in indices if not self._slots[i].tokens]
        if empty or best is None:
            return empty[0]
        return best

    def record(self, slot: int | None, tokens: Sequence[int]) -> None:
        """What the slot's cache holds after a call: prompt + generated tokens."""
        if slot is None:
            return
        with self._lock:
            self._slots[slot].tokens = list(tokens)
