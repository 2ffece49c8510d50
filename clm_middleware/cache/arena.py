"""The working KV cache of one request: block-aligned, preallocated, appended in place.

transformers' ``DynamicCache`` grows by ``torch.cat`` on every forward, which copies
the whole context per layer per decoded token, and building one from gathered
blocks copies everything twice. An arena instead holds every layer in one buffer
shaped like the pool's storage::

    [layers, kv_heads, capacity_blocks, block_size, head_dim]

so the pool's cached chain is copied in with one ``index_select`` per tensor, new
tokens are written in place, and finished blocks go back to the pool with one
``index_copy_``. Layers hand the model views ``[1, kv_heads, length, head_dim]``.

``ArenaCache`` is a ``transformers.Cache`` built from custom layers (the library's
public extension point); nothing inside the model is patched.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicLayer

from clm_middleware.cache.layout import KVLayout

if TYPE_CHECKING:
    from clm_middleware.cache.block_pool import BlockPool

ARENA_GRANULE_BLOCKS = 32  # 512 tokens at block size 16: a conversation grows into it for many turns


class ArenaLayer(DynamicLayer):
    """One layer's view of the arena; ``update`` writes in place instead of concatenating."""

    def __init__(self, arena: ArenaCache, layer: int) -> None:
        super().__init__()
        self._arena: ArenaCache = weakref.proxy(arena)  # the arena owns its layers: no cycle to collect
        self._layer = layer
        self.is_initialized = True
        self.device = arena.keys.device
        self._refresh()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the arena is allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._arena.scatter is not None:
            return self._scatter(key_states, value_states, *self._arena.scatter)
        arena, start = self._arena, self._arena.layer_lengths[self._layer]
        end = start + key_states.shape[-2]
        if end > arena.capacity_tokens:
            raise RuntimeError(f"arena overflow: {end} tokens > capacity {arena.capacity_tokens}")
        arena.flat_keys[self._layer][:, start:end] = key_states[0]
        arena.flat_values[self._layer][:, start:end] = value_states[0]
        arena.layer_lengths[self._layer] = end
        self._refresh()
        return self.keys, self.values

    def _scatter(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor, length: int):
        """Write the new K/V at ``positions`` (not appended); the first ``length`` positions attend."""
        self._arena.flat_keys[self._layer].index_copy_(1, positions, key_states[0])
        self._arena.flat_values[self._layer].index_copy_(1, positions, value_states[0])
        keys = self._arena.flat_keys[self._layer][:, :length].unsqueeze(0)
        return keys, self._arena.flat_values[self._layer][:, :length].unsqueeze(0)

    def get_seq_length(self) -> int:
        return self._arena.layer_lengths[self._layer]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        lengths = self._arena.layer_lengths
        lengths[self._layer] = max(0, lengths[self._layer] + tokens_to_remove)
        self._refresh()

    def _refresh(self) -> None:
        length = self._arena.layer_lengths[self._layer]
        self.keys = self._arena.flat_keys[self._layer][:, :length].unsqueeze(0)
        self.values = self._arena.flat_values[self._layer][:, :length].unsqueeze(0)


class ArenaCache(Cache):
    """A request's KV cache with room for ``capacity_blocks`` blocks."""

    def __init__(self, layout: KVLayout, capacity_blocks: int, block_size: int) -> None:
        shape = (
            layout.num_layers,
            layout.num_kv_heads,
            capacity_blocks,
            block_size,
            layout.head_dim,
        )
        # zero-filled so the OS maps every page now, once, in one pass: faulting them in
        # later, inside a block gather or a prefill, costs several times more (measured
        # on CPU: ~120 ms to zero a 74 MB arena, ~140-260 ms to gather into it untouched)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self.values = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.capacity_tokens = capacity_blocks * block_size
        flat = (layout.num_layers, layout.num_kv_heads, self.capacity_tokens, layout.head_dim)
        self.flat_keys = self.keys.view(flat)
        self.flat_values = self.values.view(flat)
        self.layer_lengths = [0] * layout.num_layers
        # What the arena holds, for reuse by the next request: the token ids whose K/V
        # fill positions 0..num_tokens, and the extra key (model, tenant) they were computed under.
        self.token_ids: list[int] = []
        self.extra_key = b""
        # the first position whose K/V are approximate (moved by engine/blend.py, or
        # computed after such), None when all are exact; only blending engines serve past it
        self.exact_tokens: int | None = None
        # (positions, length) while a forward writes at given positions (ArenaLayer._scatter)
        self.scatter: tuple[torch.Tensor, int] | None = None
        super().__init__(layers=[ArenaLayer(self, i) for i in range(layout.num_layers)])

    def reset_to(self, num_tokens: int) -> None:
        """Declare the first ``num_tokens`` positions filled (after a block gather)."""
        self.layer_lengths[:] = [num_tokens] * len(self.layer_lengths)
        for layer in self.layers:
            layer._refresh()

    @contextlib.contextmanager
    def scattered(self, positions: torch.Tensor, length: int) -> Iterator[None]:
        """Forwards inside write their K/V at ``positions`` and attend over ``length`` positions."""
        self.scatter = (positions, length)
        try:
            yield
        finally:
            self.scatter = None

    def reusable_tokens(self, token_ids: list[int], extra_key: bytes, *, approximate: bool = False) -> int:
        """How many leading positions already hold the K/V of ``token_ids`` (exact ones
        only unless ``approximate``)."""
        if extra_key != self.extra_key:
            return 0
        held = self.token_ids[: self.num_tokens]
        limit = min(len(held), len(token_ids))
        if not approximate and self.exact_tokens is not None:
            limit = min(limit, self.exact_tokens)
        return next((i for i in range(limit) if held[i] != token_ids[i]), limit)

    def covered_blocks(self, reusable_tokens: int, num_tokens: int) -> int:
        """How many leading blocks of a gather filling ``num_tokens`` positions need no
        copy, the arena holding ``reusable_tokens`` of them already (block ``j`` supplies
        positions up to ``min((j + 1) * block_size, num_tokens)``)."""
        if reusable_tokens >= num_tokens:
            return -(-num_tokens // self.block_size)
        return reusable_tokens // self.block_size

    @property
    def num_tokens(self) -> int:
        return self.layer_lengths[0]

    @property
    def intact(self) -> bool:
        """Whether its layers still reach it. A generation dropped mid-call and collected
        with its arena in one garbage cycle has the layers' weak proxies cleared before
        its ``finally`` hands the arena back: such an arena is never reused."""
        try:
            return all(layer._arena.capacity_tokens == self.capacity_tokens for layer in self.layers)
        except ReferenceError:
            return False

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys of positions ``0..num_tokens``, ``[kv_heads, n, head_dim]`` (a view)."""
        return self.flat_keys[layer][:, : self.layer_lengths[layer]]

    def store_blocks(self, pool: BlockPool, first_block: int, block_ids: Sequence[int]) -> None:
        """Copy this arena's blocks ``first_block, first_block + 1, ...`` into the pool's ``block_ids``."""
        pool.store_from(self, first_block, block_ids)


class ArenaRecycler:
    """Keeps a few finished arenas for reuse.

    Fresh memory costs page faults on first touch (~40 ms for 90 MB here), which
    would otherwise land in every turn's TTFT. Capacities are rounded up to a multiple
    of ``ARENA_GRANULE_BLOCKS`` so an arena fits the next, slightly longer turns. At most
    ``max_spare`` arenas are kept; the rest are freed.
    """

    def __init__(self, layout: KVLayout, block_size: int, max_spare: int = 2) -> None:
        self.layout, self.block_size, self.max_spare = layout, block_size, max_spare
        self._spare: list[ArenaCache] = []
        self._lock = threading.Lock()

    def take(
        self, capacity_blocks: int, token_ids: list[int], extra_key: bytes, *, approximate: bool = False
    ) -> tuple[ArenaCache, int]:
        """An arena with room for ``capacity_blocks``, and how many leading tokens of
        ``token_ids`` it already holds (the spare sharing the longest prefix wins;
        approximate positions count only if ``approximate``).

        With ``approximate``, a spare too small for the request still wins if it holds
        more of the prompt: its content moves into a larger arena. Its approximate K/V
        exist nowhere else (the pool holds exact blocks only), so outgrowing the arena
        must not lose them; exact content is in the pool anyway.
        """
        with self._lock:
            scored = [
                (
                    a.reusable_tokens(token_ids, extra_key, approximate=approximate),
                    a.capacity_blocks >= capacity_blocks,
                    -a.capacity_blocks,
                    i,
                )
                for i, a in enumerate(self._spare)
                if approximate or a.capacity_blocks >= capacity_blocks
            ]
            if scored:
                reusable, fits, _, best = max(scored)
                arena = self._spare.pop(best)
                if fits:
                    return arena, reusable
                return self._grown(arena, capacity_blocks), reusable
        return self._fresh(capacity_blocks), 0

    def _fresh(self, capacity_blocks: int) -> ArenaCache:
        rounded = -(-capacity_blocks // ARENA_GRANULE_BLOCKS) * ARENA_GRANULE_BLOCKS
        return ArenaCache(self.layout, rounded, self.block_size)

    def _grown(self, small: ArenaCache, capacity_blocks: int) -> ArenaCache:
        """A fresh arena of ``capacity_blocks`` holding what ``small`` held."""
        arena, held = self._fresh(capacity_blocks), small.num_tokens
        blocks = -(-held // self.block_size)
        arena.keys[:, :, :blocks] = small.keys[:, :, :blocks]
        arena.values[:, :, :blocks] = small.values[:, :, :blocks]
        arena.token_ids, arena.extra_key, arena.exact_tokens = small.token_ids, small.extra_key, small.exact_tokens
        arena.reset_to(held)
        return arena

    def give(self, arena: ArenaCache, token_ids: list[int], extra_key: bytes, exact_tokens: int | None = None) -> None:
        """Return an arena whose first ``num_tokens`` positions hold ``token_ids``' K/V,
        approximate from ``exact_tokens`` on (None: all exact)."""
        if not arena.intact:
            return
        arena.token_ids, arena.extra_key, arena.exact_tokens = token_ids, extra_key, exact_tokens
        with self._lock:
            self._spare.append(arena)
            self._spare.sort(key=lambda a: a.capacity_blocks, reverse=True)
            del self._spare[self.max_spare :]
