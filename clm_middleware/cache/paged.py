"""A request's KV cache kept in the pool's own blocks: the context is held once.

The working arena (cache/arena.py) holds a copy of the request's whole chain next to
the pool's blocks, so the active context lives twice. A paged cache instead writes
each new token's K/V straight into the pool blocks the request reserved, and hands
the model one layer's K/V at a time, gathered from the block table into a scratch
buffer the size of one layer::

    block table   [ hit 0 | hit 1 | reserved 0 | reserved 1 | ... ]   pool block ids
    layer l       pool[l][:, table] ──index_select──▶ scratch ──▶ attention of layer l

Layers run one after another, so one scratch serves them all: the extra memory is one
layer's context (1 / num_layers of a copy), and the price is a gather of the context
per layer per forward (a decode step included, except with ``compile_decode``,
whose compiled step reads the blocks in place: engine/compiled_decode.py), measured in
docs/benchmarks.md.

Invariants:
- Positions before ``writable_from`` lie in blocks other requests may read (the hit's
  cached chain): they are never written. A recomputed position there (the engine
  recomputes one cached token for its log p, or an attention window) attends with its
  fresh K/V, as in an arena, while the pool keeps the cached copy.
- Every block in the table is held by the request (one reference): hit blocks as
  acquired, the rest reserved with no key until the engine publishes them.
- A forward's own new positions attend with the K/V it just computed, at the model's
  dtype, even where the pool stores a narrower ``kv_dtype``; earlier positions come
  from the pool (rounded to ``kv_dtype`` where it is narrower: approximate, as a hit is).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cache.block_pool import BlockPool


class PagedLayer(DynamicLayer):
    """One layer of a :class:`PagedCache`; ``update`` writes into pool blocks and gathers."""

    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self._cache: PagedCache = weakref.proxy(cache)  # the cache owns its layers: no cycle to collect
        self._layer = layer
        self.is_initialized = True
        self.device = cache.device
        self.keys = self.values = cache.scratch_keys[:, :0].unsqueeze(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the storage is the pool's."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache, layer = self._cache, self._layer
        start = cache.layer_lengths[layer]
        end = start + key_states.shape[-2]
        if end > cache.capacity_tokens:
            raise RuntimeError(f"paged cache overflow: {end} tokens > capacity {cache.capacity_tokens}")
        cache.write(layer, start, key_states[0], value_states[0])
        cache.layer_lengths[layer] = end
        self.keys, self.values = cache.gather(layer, end, start, key_states[0], value_states[0])
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._cache.layer_lengths[self._layer]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        lengths = self._cache.layer_lengths
        lengths[self._layer] = max(0, lengths[self._layer] + tokens_to_remove)


class PagedCache(Cache):
    """The K/V of positions ``0..capacity_tokens`` in the pool blocks of ``block_ids``
    (position order); the first ``num_tokens`` hold K/V when it is built."""

    def __init__(self, pool: BlockPool, block_ids: list[int], *, num_tokens: int, writable_from: int) -> None:
        layout = pool.layout
        self.pool = pool
        self.block_size = pool.block_size
        self.block_ids = list(block_ids)
        self.capacity_blocks = len(block_ids)
        self.capacity_tokens = self.capacity_blocks * self.block_size
        self.writable_from = writable_from
        self.device = layout.device
        self._table = torch.tensor(self.block_ids, dtype=torch.long, device=self.device)
        scratch = (layout.num_kv_heads, self.capacity_blocks, self.block_size, layout.head_dim)
        self._scratch_keys = torch.empty(scratch, dtype=layout.dtype, device=self.device)
        self._scratch_values = torch.empty(scratch, dtype=layout.dtype, device=self.device)
        flat = (layout.num_kv_heads, self.capacity_tokens, layout.head_dim)
        self.scratch_keys = self._scratch_keys.view(flat)
        self.scratch_values = self._scratch_values.view(flat)
        self.layer_lengths = [num_tokens] * layout.num_layers
        super().__init__(layers=[PagedLayer(self, i) for i in range(layout.num_layers)])

    @property
    def num_tokens(self) -> int:
        return self.layer_lengths[0]

    @property
    def scratch_bytes(self) -> int:
        """The working memory beside the pool: one layer's K and V at the model's dtype."""
        return 2 * self._scratch_keys.numel() * self._scratch_keys.element_size()

    @property
    def table(self) -> torch.Tensor:
        """The block ids serving positions ``0..capacity_tokens``, in order (``[capacity_blocks]``)."""
        return self._table

    def write_position(self, position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one position's K/V of every layer, ``[layers, kv_heads, head_dim]``, into
        its pool block (a compiled decode step's token; ``position ≥ writable_from``)."""
        if position < self.writable_from:
            raise RuntimeError(f"position {position} lies in a cached block (writable from {self.writable_from})")
        pool_keys, pool_values = self.pool.storage()
        block, row = self.block_ids[position // self.block_size], position % self.block_size
        pool_keys[:, :, block, row] = keys.to(pool_keys.dtype)
        pool_values[:, :, block, row] = values.to(pool_values.dtype)

    def reset_to(self, num_tokens: int) -> None:
        """Declare the first ``num_tokens`` positions filled (the next forward writes after them)."""
        self.layer_lengths[:] = [num_tokens] * len(self.layer_lengths)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[kv_heads, n, head_dim]`` K/V at positions ``start..start + n`` (those
        from ``writable_from`` on) into the layer's pool blocks."""
        skip = max(0, self.writable_from - start)
        if skip >= keys.shape[1]:
            return
        positions = torch.arange(start + skip, start + keys.shape[1], device=self.device)
        blocks = self._table[positions // self.block_size]
        offsets = positions % self.block_size
        pool_keys, pool_values = self.pool.layer_storage(layer)
        pool_keys[:, blocks, offsets] = keys[:, skip:].to(pool_keys.dtype)
        pool_values[:, blocks, offsets] = values[:, skip:].to(pool_values.dtype)

    def gather(
        self, layer: int, length: int, fresh_from: int, fresh_keys: torch.Tensor, fresh_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V of positions ``0..length`` as ``[1, kv_heads, length, head_dim]``
        views of the scratch, positions from ``fresh_from`` on taken from ``fresh_*``."""
        blocks = -(-length // self.block_size)
        index = self._table[:blocks]
        pool_keys, pool_values = self.pool.layer_storage(layer)
        for head in range(pool_keys.shape[0]):
            if pool_keys.dtype == self._scratch_keys.dtype:
                torch.index_select(pool_keys[head], 0, index, out=self._scratch_keys[head, :blocks])
                torch.index_select(pool_values[head], 0, index, out=self._scratch_values[head, :blocks])
            else:  # widened from the pool's kv_dtype
                self._scratch_keys[head, :blocks] = pool_keys[head].index_select(0, index)
                self._scratch_values[head, :blocks] = pool_values[head].index_select(0, index)
        self.scratch_keys[:, fresh_from:length] = fresh_keys
        self.scratch_values[:, fresh_from:length] = fresh_values
        return self.scratch_keys[:, :length].unsqueeze(0), self.scratch_values[:, :length].unsqueeze(0)

    def store_blocks(self, pool: BlockPool, first_block: int, block_ids: Sequence[int]) -> None:
        """Nothing to copy: the K/V are in ``block_ids`` already, which must be the table's
        blocks from ``first_block`` on (the engine reserves them in position order)."""
        expected = self.block_ids[first_block : first_block + len(block_ids)]
        if pool is not self.pool or list(block_ids) != expected:
            raise RuntimeError(f"paged cache holds blocks {expected}, asked to store {list(block_ids)}")

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys of positions ``0..num_tokens``, ``[kv_heads, n, head_dim]``
        (gathered: a copy, valid until the next forward)."""
        length = self.layer_lengths[layer]
        pool_keys, _ = self.pool.layer_storage(layer)
        blocks = -(-length // self.block_size)
        gathered = pool_keys.index_select(1, self._table[:blocks]).to(self._scratch_keys.dtype)
        return gathered.flatten(1, 2)[:, :length]


WorkingCache = ArenaCache | PagedCache
"""What a request's forwards run against: a copy of its chain (arena) or the pool's blocks (paged)."""
