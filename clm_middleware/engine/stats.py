"""Per-call and cumulative engine statistics.

``cached_tokens`` were served from the block pool (or the working arena);
``prefill_tokens`` were computed. For every call ``cached_tokens + prefill_tokens ==
prompt_tokens``. Of the cached tokens, ``approximate_tokens`` were served by an engine
that opted into approximate reuse (engine/blend.py) with K/V that an exact
recompute would not give: moved after a compaction, or computed after such. The hit rate is
token-weighted: cached tokens over prompt tokens, summed over calls.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class CallStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    forced_tokens: int = 0  # a given continuation (teacher forcing), computed after the prompt
    disk_tokens: int = 0  # of cached_tokens, those brought in from the disk tier
    approximate_tokens: int = 0  # of cached_tokens, those with approximate K/V (engine/blend.py)
    blend_check_tokens: int = 0  # positions run through the first layers to choose what a blend recomputes
    ttft_s: float = 0.0
    decode_s: float = 0.0  # after the first generated token (0 for a forced continuation: nothing decoded)
    total_s: float = 0.0
    bookkeeping_s: float = 0.0  # hash + match + gather + store: the pool's own overhead
    arena_s: float = 0.0  # allocating a working cache (0 when a spare one was reused)
    observe_s: float = 0.0  # extra work for Observe: logits of every prompt position, log-softmax, attention probe
    stored_blocks: int = 0
    finish_reason: str | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (the first is in TTFT)."""
        later = self.generated_tokens - 1
        return later / self.decode_s if later > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate
        data["decode_tokens_per_s"] = self.decode_tokens_per_s
        return data


@dataclass(slots=True)
class EngineStats:
    """Sums over every call an engine served; safe to update from several threads."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    approximate_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    bookkeeping_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, call: CallStats) -> None:
        with self._lock:
            self.calls += 1
            self.prompt_tokens += call.prompt_tokens
            self.cached_tokens += call.cached_tokens
            self.prefill_tokens += call.prefill_tokens
            self.approximate_tokens += call.approximate_tokens
            self.generated_tokens += call.generated_tokens
            self.ttft_s += call.ttft_s
            self.decode_s += call.decode_s
            self.bookkeeping_s += call.bookkeeping_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            data = {
                name: getattr(self, name)
                for name in (
                    "calls",
                    "prompt_tokens",
                    "cached_tokens",
                    "prefill_tokens",
                    "approximate_tokens",
                    "generated_tokens",
                    "ttft_s",
                    "decode_s",
                    "bookkeeping_s",
                )
            }
        data["hit_rate"] = self.hit_rate
        return data
