"""A request's KV cache kept in the pool's own blocks: the context is held once.

The working arena (cache/arena.py) holds a copy of the request's whole chain next to
the pool's blocks, so the active context lives twice. A paged cache instead writes
each new token's K/V straight into the pool blocks the request reserved. How the
model then reads the past depends on its attention:

- **In place** (``attend_in_place``: the engine's own attention, engine/attention.py,
  on CPU): ``update`` hands the attention only the forward's fresh K/V, and the
  attention reads the past from the pool a tile at a time (``past_tiles``: a run of
  consecutive blocks stored at the model's dtype as a view, anything else gathered and
  widened in copies of ``PAST_TILE_TOKENS`` positions), merging the parts' softmaxes by
  their log-sum-exp. The memory beside the pool is at most one copied tile of one
  layer, whatever the context's length::

      block table   [ hit 0 | hit 1 | reserved 0 | ... ]    pool block ids
      layer l       pool[l][:, table[0:32]] ──▶ tile ──▶ partial attention ─┐
                    pool[l][:, table[32:64]] ─▶ tile ──▶ partial attention ─┼─▶ merged (log-sum-exp)
                    fresh K/V of this forward ─────────▶ causal attention ──┘

- **Gathered** (any other attention): ``update`` gathers the layer's whole context
  into a scratch buffer the size of one layer and hands it over, as transformers'
  caches do: 1 / num_layers of a copy beside the pool.

Either way a decode step with ``compile_decode`` reads the blocks in place through its
own compiled step (engine/compiled_decode.py). The costs are measured in
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
- In place, every layer's ``update`` is followed by its attention's ``take_past``
  before the forward ends (``check_past_read`` raises otherwise): an attention that
  never read the past would have attended to the fresh positions alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cache.block_pool import BlockPool

PAST_TILE_TOKENS = 512  # positions an in-place attention reads from the pool at a time


class PagedLayer(DynamicLayer):
    """One layer of a :class:`PagedCache`; ``update`` writes into pool blocks and gathers."""

    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self._cache: PagedCache = weakref.proxy(cache)  # the cache owns its layers: no cycle to collect
        self._layer = layer
        self.is_initialized = True
        self.device = cache.device
        layout = cache.pool.layout
        self.keys = self.values = torch.empty(
            (1, layout.num_kv_heads, 0, layout.head_dim), dtype=layout.dtype, device=cache.device
        )

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
        if cache.attend_in_place:
            cache.expect_past_read(layer, start)
            return key_states, value_states
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
    (position order); the first ``num_tokens`` hold K/V when it is built.

    ``attend_in_place``: the model's attention reads the past through ``take_past`` and
    ``past_tiles`` (engine/attention.py) and no scratch is allocated; else ``update``
    gathers each layer's context into a one-layer scratch."""

    def __init__(
        self,
        pool: BlockPool,
        block_ids: list[int],
        *,
        num_tokens: int,
        writable_from: int,
        attend_in_place: bool = False,
    ) -> None:
        layout = pool.layout
        self.pool = pool
        self.block_size = pool.block_size
        self.block_ids = list(block_ids)
        self.capacity_blocks = len(block_ids)
        self.capacity_tokens = self.capacity_blocks * self.block_size
        self.writable_from = writable_from
        self.device = layout.device
        self._table = torch.tensor(self.block_ids, dtype=torch.long, device=self.device)
        # _run_ends[i]: the end of the run of consecutive block ids that starts at table index i
        self._run_ends = list(range(1, self.capacity_blocks + 1))
        for index in range(self.capacity_blocks - 2, -1, -1):
            if self.block_ids[index + 1] == self.block_ids[index] + 1:
                self._run_ends[index] = self._run_ends[index + 1]
        self.attend_in_place = attend_in_place
        self._unread_past: dict[int, int] = {}  # layer -> past length its attention has yet to take
        scratch_blocks = 0 if attend_in_place else self.capacity_blocks
        scratch = (layout.num_kv_heads, scratch_blocks, self.block_size, layout.head_dim)
        self._scratch_keys = torch.empty(scratch, dtype=layout.dtype, device=self.device)
        self._scratch_values = torch.empty(scratch, dtype=layout.dtype, device=self.device)
        flat = (layout.num_kv_heads, scratch_blocks * self.block_size, layout.head_dim)
        self.scratch_keys = self._scratch_keys.view(flat)
        self.scratch_values = self._scratch_values.view(flat)
        self.layer_lengths = [num_tokens] * layout.num_layers
        super().__init__(layers=[PagedLayer(self, i) for i in range(layout.num_layers)])

    @property
    def num_tokens(self) -> int:
        return self.layer_lengths[0]

    def expect_past_read(self, layer: int, past_tokens: int) -> None:
        """Record that layer ``layer``'s attention must read positions ``0..past_tokens`` from the pool."""
        self._unread_past[layer] = past_tokens

    def take_past(self, layer: int) -> int:
        """The number of leading positions layer ``layer``'s attention reads from the pool
        (``past_tiles``) beside the fresh K/V ``update`` handed it; marks them read."""
        return self._unread_past.pop(layer, 0)

    def check_past_read(self) -> None:
        """Raise if a layer's attention never took its past since its last ``update``."""
        if self._unread_past:
            layers = sorted(self._unread_past)
            self._unread_past.clear()
            raise RuntimeError(
                f"the attention of layers {layers} never read the paged cache's past: an attend-in-place "
                "cache needs the engine's attention (engine/attention.py), which the model no longer uses"
            )

    def past_tiles(self, layer: int, length: int, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``layer``'s K/V of positions ``0..length`` from the pool, as consecutive
        ``[1, kv_heads, tokens, head_dim]`` tiles at ``dtype``, in position order. A run of
        consecutive blocks at least a tile long, stored at ``dtype``, is one tile, a view of
        the pool (no memory, any length); anything else is a copy of at most
        ``PAST_TILE_TOKENS`` positions (one alive at a time if the caller lets each go), so a
        scattered table still costs one attention call per tile. Read-only: a view is the
        pool's memory."""
        pool_keys, pool_values = self.pool.layer_storage(layer)
        same_dtype = pool_keys.dtype == dtype
        step = max(1, PAST_TILE_TOKENS // self.block_size)
        blocks = -(-length // self.block_size)
        first = 0
        while first < blocks:
            run_end = min(blocks, self._run_ends[first])  # blocks first..run_end are consecutive ids
            if same_dtype and run_end - first >= min(step, blocks - first):  # a tile's worth (or the rest)
                end, start_id = run_end, self.block_ids[first]
                keys = pool_keys[:, start_id : start_id + end - first]
                values = pool_values[:, start_id : start_id + end - first]
            else:  # gathered contiguous first: widening a strided view is many times slower
                end = min(blocks, first + step)
                index = self._table[first:end]
                keys = pool_keys.index_select(1, index).to(dtype)
                values = pool_values.index_select(1, index).to(dtype)
            tokens = min(length, end * self.block_size) - first * self.block_size
            yield keys.flatten(1, 2)[:, :tokens].unsqueeze(0), values.flatten(1, 2)[:, :tokens].unsqueeze(0)
            first = end

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
