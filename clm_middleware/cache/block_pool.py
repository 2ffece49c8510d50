"""A bounded pool of fixed-size KV blocks with prefix-chained keys and an LRU free queue.

Every block is in exactly one of three states::

    free (no key)  ──allocate──▶  in use (ref_count ≥ 1)  ──release to 0──▶  cached-free (key, LRU)
         ▲                              ▲          │ commit gives it a key         │
         └──────── evict (LRU head) ────┼──────────┼───────────────────────────────┘
                                        └── match / acquire (hit) ◀────────────────┘

A chain's last block may be *partial* (1 to ``block_size - 1`` tokens): the tail of
what a request computed, kept so that the next prompt extending it reuses every token
(token-exact reuse, as llama.cpp's prompt cache does). Cached blocks are never written
again (copy-on-extend): a request that extends a tail gathers it, computes the rest and
stores the longer block as a new one. A block can also serve just its first ``n``
tokens: K/V at a position depends only on the tokens up to it. So below one parent::

    anchor ──▶ [a b c d]          full block
           └─▶ [a b]              partial: redundant once a sibling starts with a b
    prompt:    [a b x ...]        match_tail serves 2 tokens from either

Invariants (checked by ``check_invariants`` in tests):
1. ``_cached`` maps a key to the one block holding it; a block has a key iff it is in
   ``_cached``. A hit returns a block only if its stored token ids and parent key equal
   the request's, so a 64-bit key collision can never serve the wrong KV; a tail hit
   compares the token ids themselves, under the chain hash (``anchor``) of every block
   before it, which mixes in the model and tenant like a key does.
2. ``_lru`` holds exactly the cached blocks whose ``ref_count`` is 0, oldest release
   first; ``_free`` holds exactly the blocks with no key and ``ref_count`` 0.
3. Room is made only when an allocation needs it: first from ``_free``, then by
   evicting the LRU head. Blocks in use are never evicted.
4. ``_children[anchor]`` holds exactly the cached blocks chained from ``anchor``. A
   partial block with ``ref_count`` 0 is never redundant (its tokens the proper prefix
   of a sibling's, which serves everything it could): it is freed instead of cached.
5. K/V storage is preallocated once per pool (``[layers, kv_heads, blocks, block_size,
   head_dim]``); a turn copies only the blocks it reads or writes.

``_lru`` is an ``OrderedDict`` rather than a ``deque``: a hit must remove a block from
the middle of the queue, which is O(1) in a linked hash map and O(n) in a deque.
All metadata changes happen under one lock; tensor reads and writes touch only blocks
the caller holds a reference on, so they run outside it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cache.hashing import BlockKey
from clm_middleware.cache.layout import KVLayout, PoolConfig
from clm_middleware.errors import PoolExhaustedError, PoolTooSmallError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None
    parent_key: BlockKey | None = None
    token_ids: tuple[int, ...] = ()
    # log p of each token given every token before it, where the request that computed
    # the block measured it (None elsewhere): a property of the prefix, like the K/V, so
    # a hit serves it too and a conversation's scores never depend on who cached first
    logprobs: tuple[float | None, ...] | None = None
    # the chain hash this block's key was computed from: the parent's key, or the root
    # key (model + tenant) for a chain's first block, whose parent_key is None
    anchor: BlockKey | None = None
    # (token, log p) of the token that followed this block in the request that computed
    # it, where measured: the next request that extends the block needs that log p
    # and would otherwise recompute one cached token to get it
    next_logprob: tuple[int, float] | None = None


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    block_size: int
    blocks_in_use: int
    blocks_cached_free: int
    blocks_free: int
    evictions: int
    hit_blocks: int
    block_bytes: int

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V currently holding data (in use or cached)."""
        return (self.blocks_in_use + self.blocks_cached_free) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def as_dict(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "blocks_in_use": self.blocks_in_use,
            "blocks_cached_free": self.blocks_cached_free,
            "blocks_free": self.blocks_free,
            "evictions": self.evictions,
            "hit_blocks": self.hit_blocks,
            "kv_bytes": self.kv_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


EvictedBlock = tuple[BlockKey, "BlockKey | None", tuple[int, ...], torch.Tensor, torch.Tensor]
EvictionListener = Callable[[BlockKey, "BlockKey | None", tuple[int, ...], torch.Tensor, torch.Tensor], None]
"""``f(key, parent_key, token_ids, keys, values)`` for a block leaving memory (see ``DiskTier``)."""
POOL_HINT = "raise max_kv_bytes / max_blocks, lower max_new_tokens, or set a smaller context budget"
PressureListener = Callable[[int], None]
"""``f(num_blocks)``: an allocation of ``num_blocks`` found too little room; give back
references that can wait (an idle conversation's cached chain, see ``SessionRouter``)."""


class BlockPool:
    def __init__(self, layout: KVLayout, config: PoolConfig | None = None) -> None:
        self.layout = layout
        self.config = config or PoolConfig()
        self.block_size = self.config.block_size
        self.num_blocks = self.config.num_blocks(layout)
        self.kv_dtype = self.config.storage_dtype(layout)  # the model's dtype unless PoolConfig.kv_dtype says
        self.exact = self.kv_dtype == layout.dtype  # False: a hit serves K/V rounded to kv_dtype
        self.block_bytes = layout.bytes_per_token_as(self.kv_dtype) * self.block_size
        shape = (
            layout.num_layers,
            layout.num_kv_heads,
            self.num_blocks,
            self.block_size,
            layout.head_dim,
        )
        # torch.empty reserves address space; pages are committed only when written.
        self._keys = torch.empty(shape, dtype=self.kv_dtype, device=layout.device)
        self._values = torch.empty(shape, dtype=self.kv_dtype, device=layout.device)
        self._blocks = [Block(block_id) for block_id in range(self.num_blocks)]
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}
        self._children: dict[BlockKey, dict[int, None]] = {}
        self._lock = threading.RLock()
        self._evictions = 0
        self._hit_blocks = 0
        self._eviction_listeners: list[EvictionListener] = []
        self._pressure_listeners: list[PressureListener] = []
        self._deferred: deque[Callable[[], None]] = deque()  # see ``call_soon``

    # ---------------------------------------------------------------- lookup

    def match(self, keys: Sequence[BlockKey], token_ids: Sequence[int]) -> list[int]:
        """Acquire the longest cached chain for ``keys``; returns its block ids.

        ``token_ids`` are the request's tokens from position 0, used to confirm each
        hit. Every returned block has had its ref_count raised by one.
        """
        size = self.block_size
        matched: list[int] = []
        with self._lock:
            parent: BlockKey | None = None
            for index, key in enumerate(keys):
                block_id = self._cached.get(key)
                if block_id is None:
                    break
                block = self._blocks[block_id]
                expected = tuple(token_ids[index * size : (index + 1) * size])
                if block.token_ids != expected or block.parent_key != parent:
                    break  # a key collision: treat as a miss, never serve it
                self._acquire_locked(block)
                matched.append(block_id)
                parent = key
            self._hit_blocks += len(matched)
        return matched

    def match_tail(self, anchor: BlockKey, token_ids: Sequence[int], max_tokens: int) -> tuple[int, int] | None:
        """Acquire the cached block chained from ``anchor`` whose leading tokens agree
        longest with ``token_ids`` (at most ``max_tokens``); ``(block_id, tokens)`` or None.

        The block may be partial or full; only its first ``tokens`` positions may be
        used. Among equal matches the shortest block wins: when it is used whole, its
        ``next_logprob`` applies.
        """
        limit = min(max_tokens, len(token_ids), self.block_size)
        if limit < 1:
            return None
        with self._lock:
            best: tuple[int, int, int] | None = None  # (tokens, -length, block id)
            for block_id in self._children.get(anchor, ()):
                stored = self._blocks[block_id].token_ids
                same = _common_prefix(stored, token_ids, limit)
                if same and (best is None or (same, -len(stored)) > best[:2]):
                    best = (same, -len(stored), block_id)
            if best is None:
                return None
            self._acquire_locked(self._blocks[best[2]])
            self._hit_blocks += 1
        return best[2], best[0]

    def next_logprob(self, block_id: int) -> tuple[int, float] | None:
        """See ``Block.next_logprob``; call while holding the block."""
        with self._lock:
            return self._blocks[block_id].next_logprob

    def logprobs(self, block_ids: Sequence[int]) -> list[tuple[float | None, ...] | None]:
        """The measured log-probs of each block (see ``Block.logprobs``); call while holding them."""
        with self._lock:
            return [self._blocks[b].logprobs for b in block_ids]

    def cached_block(self, key: BlockKey) -> int | None:
        """The block holding ``key``, if any (no reference taken)."""
        with self._lock:
            return self._cached.get(key)

    # ------------------------------------------------------------ allocation

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.available_blocks()

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` empty blocks (ref_count 1), evicting LRU blocks if needed.

        When the blocks in use leave too little room, the pressure listeners are asked
        (outside the lock, until the room is there; those with a ``last_used`` time
        oldest first) to give back references that can wait. Raises
        :class:`PoolTooSmallError` when ``num_blocks`` exceeds the whole pool,
        :class:`PoolExhaustedError` when the room is still short; either without
        changing anything. Eviction listeners run after the lock is released,
        on copies, so a slow listener (disk) never blocks others.
        """
        self._run_deferred()
        if num_blocks > self.num_blocks:
            raise PoolTooSmallError(
                f"the request needs {num_blocks} KV blocks of {self.block_size} tokens; the pool has "
                f"{self.num_blocks} in all",
                hint=POOL_HINT,
            )
        evicted: list[EvictedBlock] = []
        allocated = self._allocate_now(num_blocks, evicted)
        # least recently used first, for listeners that say (a conversation's ``last_used``)
        listeners = sorted(self._pressure_listeners, key=lambda listener: getattr(listener, "last_used", 0.0))
        for listener in listeners if allocated is None else []:
            listener(num_blocks)
            if (allocated := self._allocate_now(num_blocks, evicted)) is not None:
                break
        if allocated is None:
            in_use = self.num_blocks - self.available_blocks()
            raise PoolExhaustedError(
                f"the KV pool cannot supply {num_blocks} blocks: it has {self.num_blocks} blocks of "
                f"{self.block_size} tokens and {in_use} are held by running requests and open conversations",
                hint=POOL_HINT,
            )
        self._notify_evicted(evicted)
        return allocated

    def _allocate_now(self, num_blocks: int, evicted: list[EvictedBlock]) -> list[int] | None:
        """``allocate`` without asking anyone for room; None (nothing changed) when short."""
        with self._lock:
            if num_blocks > len(self._free) + len(self._lru):
                return None
            allocated = []
            for _ in range(num_blocks):
                block = self._blocks[self._free.pop()] if self._free else self._evict_locked(evicted)
                block.ref_count = 1
                allocated.append(block.block_id)
        return allocated

    def call_soon(self, work: Callable[[], None]) -> None:
        """Run ``work`` at the start of the next allocation, outside the lock. For a
        finalizer that gives references back: the garbage collector may run it while this
        thread is inside the pool (its lock is re-entrant), where a release would change
        the pool mid-operation."""
        self._deferred.append(work)

    def _run_deferred(self) -> None:
        while self._deferred:
            work = self._deferred.popleft()
            try:
                work()
            except Exception:
                log.exception("deferred pool work failed")

    def available_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody holds."""
        with self._lock:
            return len(self._free) + len(self._lru)

    def _notify_evicted(self, evicted: list[EvictedBlock]) -> None:
        """Listeners are optimisations (a disk tier): one that raises is logged, and the
        blocks already handed out stay the caller's, so no reference is left unowned."""
        for listener in self._eviction_listeners:
            for record in evicted:
                try:
                    listener(*record)
                except Exception:
                    log.exception("an eviction listener failed; the evicted block is not kept")

    def commit(
        self,
        block_id: int,
        key: BlockKey,
        parent_key: BlockKey | None,
        token_ids: Sequence[int],
        logprobs: Sequence[float | None] | None = None,
        *,
        anchor: BlockKey | None = None,
        next_logprob: tuple[int, float] | None = None,
    ) -> int:
        """Publish a freshly written block under ``key``; returns the block now holding it.

        ``token_ids`` may be fewer than ``block_size`` (a chain's partial tail).
        ``anchor`` is the hash ``key`` was chained from (``parent_key``, or the root key
        for a first block); only a block with an anchor can serve a tail hit.

        If another request committed the same key first, ``block_id`` is returned to
        the free list and the existing block is acquired instead (gaining the log-probs
        it lacked from ``logprobs``), so every key is held once and the caller's block
        table stays correct. Unreferenced partial siblings the new block makes redundant
        are freed (invariant 4).
        """
        tokens = tuple(token_ids)
        if not 1 <= len(tokens) <= self.block_size:
            raise RuntimeError(f"commit: {len(tokens)} tokens do not fit a block of {self.block_size}")
        measured = tuple(logprobs) if logprobs is not None and any(v is not None for v in logprobs) else None
        anchor = parent_key if anchor is None else anchor
        with self._lock:
            block = self._blocks[block_id]
            if block.key is not None or block.ref_count != 1:
                raise RuntimeError(f"commit: block {block_id} is not a fresh allocation")
            existing_id = self._cached.get(key)
            if existing_id is not None:
                existing = self._blocks[existing_id]
                if existing.token_ids == tokens and existing.parent_key == parent_key:
                    existing.logprobs = _merged(existing.logprobs, measured)
                    existing.next_logprob = next_logprob or existing.next_logprob
                    self._acquire_locked(existing)
                    self._release_locked(block)
                    return existing_id
                return block_id  # a collision with different content: keep ours uncached
            block.key, block.parent_key, block.token_ids = key, parent_key, tokens
            block.logprobs, block.anchor, block.next_logprob = measured, anchor, next_logprob
            self._cached[key] = block_id
            if anchor is not None:
                for sibling_id in list(self._children.get(anchor, ())):
                    sibling = self._blocks[sibling_id]
                    if sibling.ref_count == 0 and _is_proper_prefix(sibling.token_ids, tokens):
                        del self._lru[sibling_id]
                        self._uncache_locked(sibling)
                        self._free.append(sibling_id)
                self._children.setdefault(anchor, {})[block_id] = None
            return block_id

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (cached-free blocks leave the LRU queue)."""
        with self._lock:
            for block_id in block_ids:
                block = self._blocks[block_id]
                if block.ref_count == 0 and block.key is None:
                    raise RuntimeError(f"acquire: block {block_id} holds no data")
                self._acquire_locked(block)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the order given.

        Callers release a chain tail-first, so the LRU queue evicts a chain's last
        blocks before its first ones and a shorter prefix keeps hitting.
        """
        with self._lock:
            for block_id in block_ids:
                self._release_locked(self._blocks[block_id])

    # --------------------------------------------------------------- tensors

    def gather_into(
        self, block_ids: Sequence[int], arena: ArenaCache, *, num_tokens: int | None = None, skip_blocks: int = 0
    ) -> None:
        """Copy the blocks' K/V, in order, to the start of ``arena`` (one copy per tensor),
        and declare its first ``num_tokens`` positions filled (default: every block's).

        The first ``skip_blocks`` are not copied: the caller knows the arena already
        holds exactly those tokens' K/V (see ``ArenaCache.reusable_tokens``).
        """
        count = len(block_ids)
        if count > skip_blocks:
            index = torch.tensor(block_ids[skip_blocks:], device=self._keys.device)
            span = slice(skip_blocks, count)
            if self.exact:
                torch.index_select(self._keys, 2, index, out=arena.keys[:, :, span])
                torch.index_select(self._values, 2, index, out=arena.values[:, :, span])
            else:  # widened to the arena's dtype on the way in
                arena.keys[:, :, span] = self._keys.index_select(2, index)
                arena.values[:, :, span] = self._values.index_select(2, index)
        arena.reset_to(count * self.block_size if num_tokens is None else num_tokens)

    def store_from(self, arena: ArenaCache, first_block: int, block_ids: Sequence[int]) -> None:
        """Copy arena blocks ``first_block, first_block + 1, ...`` into ``block_ids``."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, device=self._keys.device)
        span = slice(first_block, first_block + len(block_ids))
        self._keys.index_copy_(2, index, arena.keys[:, :, span].to(self.kv_dtype))
        self._values.index_copy_(2, index, arena.values[:, :, span].to(self.kv_dtype))

    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V storage, ``[kv_heads, num_blocks, block_size, head_dim]``
        views at ``kv_dtype``, for a cache that attends over blocks in place
        (cache/paged.py). Its caller reads only blocks it holds a reference on and writes
        only held blocks that have no key yet (invariant 5: cached blocks are never written)."""
        return self._keys[layer], self._values[layer]

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K and V storage, ``[layers, kv_heads, num_blocks, block_size,
        head_dim]`` at ``kv_dtype``, under the same contract as :meth:`layer_storage`."""
        return self._keys, self._values

    def copy_block(self, source: int, target: int) -> None:
        """Copy block ``source``'s K/V into ``target`` (held, no key): copy-on-extend of a cached tail."""
        self._keys[:, :, target] = self._keys[:, :, source]
        self._values[:, :, target] = self._values[:, :, source]

    def read_block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one block, ``[layers, kv_heads, block_size, head_dim]`` each (a copy, as stored: ``kv_dtype``)."""
        return self._keys[:, :, block_id].clone(), self._values[:, :, block_id].clone()

    def write_block(self, block_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one block's K/V (converted to ``kv_dtype``)."""
        self._keys[:, :, block_id] = keys
        self._values[:, :, block_id] = values

    # ------------------------------------------------------------ inspection

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(key, parent_key, token_ids, keys, values)`` for each evicted block."""
        self._eviction_listeners.append(listener)

    def add_pressure_listener(self, listener: PressureListener) -> None:
        """Ask ``listener(num_blocks)`` for room when an allocation finds too little (see
        ``allocate``). It runs in the allocating thread, never under the pool's lock.
        Listeners whose ``alive`` says False (their owner was collected) leave here."""
        live = [known for known in self._pressure_listeners if getattr(known, "alive", True)]
        self._pressure_listeners = [*live, listener]

    def remove_pressure_listener(self, listener: PressureListener) -> None:
        """Stop asking ``listener``; one never added is ignored."""
        if listener in self._pressure_listeners:
            self._pressure_listeners.remove(listener)

    def block(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def ref_counts(self, block_ids: Sequence[int]) -> list[int]:
        with self._lock:
            return [self._blocks[block_id].ref_count for block_id in block_ids]

    def lru_order(self) -> list[int]:
        """Cached-free block ids, next to be evicted first."""
        with self._lock:
            return list(self._lru)

    def stats(self) -> PoolStats:
        with self._lock:
            free, cached_free = len(self._free), len(self._lru)
            return PoolStats(
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                blocks_in_use=self.num_blocks - free - cached_free,
                blocks_cached_free=cached_free,
                blocks_free=free,
                evictions=self._evictions,
                hit_blocks=self._hit_blocks,
                block_bytes=self.block_bytes,
            )

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants of the module docstring (for tests)."""
        with self._lock:
            for block in self._blocks:
                if block.ref_count > 0:
                    assert block.block_id not in self._lru and block.block_id not in self._free
                elif block.key is not None:
                    assert block.block_id in self._lru
                else:
                    assert block.block_id in self._free
                if block.key is not None:
                    assert self._cached[block.key] == block.block_id
                    assert 1 <= len(block.token_ids) <= self.block_size
                    if block.anchor is not None:
                        assert block.block_id in self._children[block.anchor]
                    if block.ref_count == 0 and len(block.token_ids) < self.block_size:
                        assert not self._is_redundant_locked(block)
            assert len(self._cached) == sum(b.key is not None for b in self._blocks)
            indexed = [(anchor, b) for anchor, children in self._children.items() for b in children]
            assert all(self._blocks[b].anchor == anchor for anchor, b in indexed)
            assert len(indexed) == sum(b.anchor is not None for b in self._blocks if b.key is not None)

    # -------------------------------------------------------------- internal

    def _acquire_locked(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._lru[block.block_id]
        block.ref_count += 1

    def _release_locked(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"release: block {block.block_id} has no reference to drop")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None and self._is_redundant_locked(block):
                self._uncache_locked(block)
            if block.key is None:
                self._free.append(block.block_id)
            else:
                self._lru[block.block_id] = None

    def _is_redundant_locked(self, block: Block) -> bool:
        """A partial block whose tokens a sibling block starts with (invariant 4)."""
        if block.anchor is None or len(block.token_ids) == self.block_size:
            return False
        siblings = self._children.get(block.anchor, {})
        return any(_is_proper_prefix(block.token_ids, self._blocks[s].token_ids) for s in siblings)

    def _uncache_locked(self, block: Block) -> None:
        del self._cached[block.key]
        if block.anchor is not None:
            siblings = self._children[block.anchor]
            del siblings[block.block_id]
            if not siblings:
                del self._children[block.anchor]
        block.key, block.parent_key, block.token_ids, block.logprobs = None, None, (), None
        block.anchor, block.next_logprob = None, None

    def _evict_locked(self, evicted: list) -> Block:
        block_id, _ = self._lru.popitem(last=False)
        block = self._blocks[block_id]
        # the disk tier keeps full blocks only: a tail is at most block_size - 1 tokens to recompute
        if self._eviction_listeners and len(block.token_ids) == self.block_size:
            keys, values = self.read_block(block_id)
            evicted.append((block.key, block.parent_key, block.token_ids, keys, values))
        self._uncache_locked(block)
        self._evictions += 1
        return block

    def cached_blocks(self) -> list[Block]:
        """Every block holding a key (in use or cached-free), as snapshots."""
        with self._lock:
            return [replace(b) for b in self._blocks if b.key is not None]


def _merged(
    kept: tuple[float | None, ...] | None, new: tuple[float | None, ...] | None
) -> tuple[float | None, ...] | None:
    """``kept`` with its gaps filled from ``new`` (values of one prefix agree where both have one)."""
    if kept is None or new is None:
        return kept or new
    return tuple(k if k is not None else n for k, n in zip(kept, new, strict=True))


def _common_prefix(stored: Sequence[int], wanted: Sequence[int], limit: int) -> int:
    """How many leading tokens ``stored`` and ``wanted`` share, at most ``limit``."""
    limit = min(limit, len(stored), len(wanted))
    return next((i for i in range(limit) if stored[i] != wanted[i]), limit)


def _is_proper_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) < len(long) and tuple(long[: len(short)]) == tuple(short)
