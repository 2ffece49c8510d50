"""The ``pool`` of an engine whose KV cache lives on the server.

vLLM's prefix cache, SGLang's radix tree and llama.cpp's slots hold and evict their
own blocks; we cannot pin or reclaim them. So the lifecycle layer's references (a
conversation's chain, the reclaimer's K-round holds) are empty here, and the pool
statistics are zeros: the cache figures of a remote turn are the server's
(``CallStats.cached_tokens``), not ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clm_middleware.cache.block_pool import PoolStats


@dataclass(frozen=True, slots=True)
class NullPoolConfig:
    block_size: int = 16


class NullPool:
    """Satisfies ``engine.protocol.KVPool``; holds nothing."""

    def __init__(self, block_size: int = 16) -> None:
        self.config = NullPoolConfig(block_size)
        self.block_size = block_size

    def acquire(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            raise RuntimeError("a remote engine hands out no blocks; nothing can be acquired")

    def release(self, block_ids: Sequence[int]) -> None:
        if list(block_ids):
            raise RuntimeError("a remote engine hands out no blocks; nothing can be released")

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=0,
            block_size=self.block_size,
            blocks_in_use=0,
            blocks_cached_free=0,
            blocks_free=0,
            evictions=0,
            hit_blocks=0,
            block_bytes=0,
        )
