"""Delayed K-round reclamation of the blocks of segments that left the context.

When a segment is dropped or replaced by its summary, the pool blocks that held its
tokens are not released at once: the reclaimer keeps one reference on them for K
rounds (turns). If the segment comes back within that time (relabelled keep, or the
new user turn refers to it), it is rendered again at its old place and its blocks
still hit. After K rounds the reference is dropped and the blocks join the pool's
LRU free queue like any other cached block.
"""

from __future__ import annotations

from dataclasses import dataclass

from clm_middleware.engine.protocol import KVPool
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.segments import SegmentId


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    release_round: int


class Reclaimer:
    def __init__(self, pool: KVPool, k: int) -> None:
        if k < 0:
            raise ConfigError("k", f"must be ≥ 0, got {k}")
        self.pool, self.k = pool, k
        self._holds: dict[SegmentId, _Hold] = {}

    def hold(self, segment: SegmentId, block_ids: list[int], current_round: int) -> None:
        """Keep ``block_ids`` referenced until round ``current_round + k``."""
        self.forget(segment)
        if not block_ids:
            return
        self.pool.acquire(block_ids)
        self._holds[segment] = _Hold(list(block_ids), current_round + self.k)

    def is_held(self, segment: SegmentId) -> bool:
        return segment in self._holds

    def release_due(self, current_round: int) -> int:
        """Release every hold whose K rounds are over; returns the number of blocks released."""
        released = 0
        for segment in [s for s, hold in self._holds.items() if hold.release_round <= current_round]:
            released += len(self._holds[segment].block_ids)
            self.forget(segment)
        return released

    def forget(self, segment: SegmentId) -> None:
        hold = self._holds.pop(segment, None)
        if hold is not None:
            self.pool.release(list(reversed(hold.block_ids)))

    @property
    def held_blocks(self) -> int:
        return sum(len(hold.block_ids) for hold in self._holds.values())

    def close(self) -> None:
        for segment in list(self._holds):
            self.forget(segment)
