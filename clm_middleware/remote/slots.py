"""A stable llama.cpp slot per conversation, without knowing conversations.

llama.cpp keeps one cached prompt per slot, so a conversation's prefix hits only if
its next request goes to the slot that served its last one. We send ``id_slot``
explicitly: the slot whose last prompt + reply, or last prompt, the new prompt extends
(that is the conversation's own slot: its next prompt starts with all of it, or with
all but the reply when the reply was kept out of the context); see
``SlotTable._choose`` for the order when none does. The engine need not be told which
conversation a call belongs to, and a plain (stateless) client gets the same treatment.

Tenants: a slot remembers the cache salt of its last request. A request reuses a slot's
cache (llama.cpp ``cache_prompt``) only when the slot last served the same salt: one
tenant never hits, or reads in ``cached_tokens``, what another sent. With a salt, an
empty slot is not reused either (a server may fill it from a prompt cache of its own).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Slot:
    tokens: list[int] = field(default_factory=list)
    prompt_length: int = 0  # how many of ``tokens`` its last request sent; the rest it generated
    last_used: int = 0
    busy: int = 0  # requests sent to it and not recorded yet
    salt: str | None = None  # the cache salt of its last request


@dataclass(frozen=True, slots=True)
class SlotClaim:
    """Where one request goes: ``slot`` (llama.cpp ``id_slot``) and whether it may reuse
    what the slot caches (``cache_prompt``)."""

    slot: int
    reuse: bool


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotTable:
    """Thread-safe; ``num_slots == 0`` means the server has no slots to pick (``pick`` returns None).
    Every claim from ``pick`` is given back with ``record``, whether the request succeeded or not."""

    def __init__(self, num_slots: int, *, generation_prompt_length: int = 0) -> None:
        """``generation_prompt_length``: how many ids end every prompt to open the reply
        (the chat template's assistant header); a next prompt without the last reply
        lacks them too."""
        self._slots = [_Slot() for _ in range(max(0, num_slots))]
        self._header = max(0, generation_prompt_length)
        self._clock = 0
        self._lock = threading.Lock()

    def pick(self, prompt: Sequence[int], salt: str | None = None, *, reuse: bool = True) -> SlotClaim | None:
        """Claim a slot for ``prompt``; ``reuse=False`` asks for no cache reuse at all."""
        if not self._slots:
            return None
        with self._lock:
            self._clock += 1
            best = self._choose(prompt, salt)
            slot = self._slots[best]
            same_tenant = slot.salt == salt and (salt is None or bool(slot.tokens))
            slot.last_used, slot.busy, slot.salt = self._clock, slot.busy + 1, salt
            slot.tokens = list(prompt)  # claimed now, so a concurrent pick sees it
            slot.prompt_length = len(prompt)
            return SlotClaim(best, reuse and same_tenant)

    def _choose(self, prompt: Sequence[int], salt: str | None) -> int:
        """Among the idle slots (all of them when every slot is busy), those of the same
        salt: 1. one whose whole content, or whole last prompt but its generation prompt,
        starts the prompt (the longest: the conversation's own slot, with no lifecycle
        change, its last reply left out of the context as a flagged repeat is, or the same
        prompt asked again); 2. an empty slot (a new conversation does not evict one it
        merely shares a system prompt with, however long: two conversations that took
        turns in one slot would re-prefill every turn); 3. the slot whose content the
        prompt reuses the largest share of (its own after a lifecycle change), another
        tenant's counting as none; the least recently used on a tie."""
        idle = [i for i, slot in enumerate(self._slots) if not slot.busy]
        candidates = idle or list(range(len(self._slots)))
        shared = {i: common_prefix(self._slots[i].tokens, prompt) for i in candidates}
        own = [i for i in candidates if self._slots[i].tokens and self._slots[i].salt == salt]
        extended = [
            i
            for i in own
            if shared[i] == len(self._slots[i].tokens) or shared[i] >= self._slots[i].prompt_length - self._header > 0
        ]
        if extended:
            return max(extended, key=lambda i: shared[i])
        empty = [i for i in candidates if not self._slots[i].tokens]
        if empty:
            return empty[0]

        def reused_share(i: int) -> float:
            return shared[i] / len(self._slots[i].tokens) if i in own else 0.0

        return max(candidates, key=lambda i: (reused_share(i), -self._slots[i].last_used))

    def record(self, claim: SlotClaim | None, tokens: Sequence[int]) -> None:
        """What the claimed slot's cache holds after the call (prompt + generated tokens);
        the claim ends."""
        if claim is None:
            return
        with self._lock:
            slot = self._slots[claim.slot]
            slot.tokens = list(tokens)
            slot.busy = max(0, slot.busy - 1)
