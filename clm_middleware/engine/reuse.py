"""Prefix reuse for one request: what the pool (and disk tier) already holds, and what
the request adds back.

Reuse is token-exact: full blocks are matched by their chained keys, then the block at
the first miss is looked up by its tokens under the chain hash so far (``match_tail``),
which serves the partial tail a previous request stored, or the leading tokens of a
block that diverges mid-way. Positions covered::

    prompt   [ block 0 | block 1 | block 2 |  tail   ·  new ...  ]
    served    chain[0]   chain[1]  chain[2]  tail[:n]
    computed                                         ^ start = 3 × block_size + n

At least one prompt token is always left to compute (the last position's logits pick
the first generated token). What was computed goes back as new blocks, the last one
partial when the request ended mid-block; the hit blocks themselves are never written
(other requests may be reading them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.disk import DiskTier
from clm_middleware.cache.hashing import BlockKey, block_key, chain_keys, root_key
from clm_middleware.cache.paged import WorkingCache
from clm_middleware.errors import PoolExhaustedError


@dataclass(slots=True)
class PrefixHit:
    """The blocks serving a prompt's first ``start`` positions; one reference on each."""

    block_size: int
    chain: list[int] = field(default_factory=list)  # full blocks from position 0, in order
    keys: list[BlockKey] = field(default_factory=list)  # their keys
    tail: int | None = None  # the block serving the next ``tail_tokens`` positions
    tail_tokens: int = 0
    disk_tokens: int = 0

    @property
    def start(self) -> int:
        return len(self.chain) * self.block_size + self.tail_tokens

    @property
    def blocks(self) -> list[int]:
        """Every block to gather, in position order."""
        return self.chain if self.tail is None else [*self.chain, self.tail]

    def release(self, pool: BlockPool) -> None:
        """Give every reference back, the tail first (the LRU queue then evicts a chain's
        end before its beginning)."""
        pool.release(list(reversed(self.blocks)))
        self.chain, self.keys, self.tail, self.tail_tokens = [], [], None, 0

    def gather_into(self, pool: BlockPool, arena: ArenaCache, reusable_tokens: int) -> int:
        """Fill the arena's first ``start`` positions, copying only blocks it lacks; the
        end of the copied blocks (0 if none was), past which the arena is as it was."""
        blocks = self.blocks
        skip = min(len(blocks), arena.covered_blocks(reusable_tokens, self.start))
        pool.gather_into(blocks, arena, num_tokens=self.start, skip_blocks=skip)
        return len(blocks) * self.block_size if skip < len(blocks) else 0

    def known_logprob(self, pool: BlockPool, prompt: Sequence[int]) -> float | None:
        """``log p(prompt[start] | prompt[:start])`` if the last served block measured it
        (its ``next_logprob``, for the token that followed it, when this prompt goes on
        with the same token)."""
        if self.start == 0 or self.start >= len(prompt):
            return None
        last, used = (self.tail, self.tail_tokens) if self.tail is not None else (self.chain[-1], self.block_size)
        if used != len(pool.block(last).token_ids):
            return None
        after = pool.next_logprob(last)
        return after[1] if after is not None and after[0] == prompt[self.start] else None

    def cached_logprobs(self, pool: BlockPool, num_tokens: int) -> list[float | None]:
        """Per position, the log-prob the served blocks measured (None elsewhere)."""
        size, logprobs = self.block_size, [None] * num_tokens
        for index, measured in enumerate(pool.logprobs(self.blocks)):
            used = self.tail_tokens if index == len(self.chain) else size
            for offset, value in enumerate((measured or ())[:used]):
                logprobs[index * size + offset] = value
        return logprobs


def match_prefix(pool: BlockPool, disk: DiskTier | None, prompt: list[int], extra_key: bytes) -> PrefixHit:
    """The longest reusable prefix of ``prompt``, leaving at least its last token to compute."""
    size = pool.block_size
    hit = PrefixHit(size)
    hit.keys = chain_keys(prompt, size, extra_key, num_blocks=(len(prompt) - 1) // size)
    hit.chain = pool.match(hit.keys, prompt)
    if disk is not None and len(hit.chain) < len(hit.keys):
        loaded = _from_disk(pool, disk, prompt, hit.keys, len(hit.chain), extra_key)
        hit.disk_tokens = len(loaded) * size
        hit.chain.extend(loaded)
    del hit.keys[len(hit.chain) :]
    start = len(hit.chain) * size
    anchor = hit.keys[-1] if hit.keys else root_key(extra_key)
    tail = pool.match_tail(anchor, prompt[start:], len(prompt) - 1 - start)
    if tail is not None:
        hit.tail, hit.tail_tokens = tail
    return hit


def _from_disk(
    pool: BlockPool, disk: DiskTier, prompt: list[int], keys: list[BlockKey], start: int, extra_key: bytes
) -> list[int]:
    """Blocks ``start, start + 1, ...`` of the chain from the disk tier, until one is
    missing; each is brought into the pool (acquired, one reference) and published."""
    size, layout = pool.block_size, pool.layout
    shape = (layout.num_layers, layout.num_kv_heads, size, layout.head_dim)
    loaded: list[int] = []
    for index in range(start, len(keys)):
        parent = keys[index - 1] if index else None
        tokens = prompt[index * size : (index + 1) * size]
        kv = disk.read(keys[index], parent, tokens, shape, pool.kv_dtype)
        if kv is None:
            break
        try:
            [block_id] = pool.allocate(1)
        except PoolExhaustedError:
            break  # no room to bring it in: compute it instead
        pool.write_block(block_id, kv[0].to(layout.device), kv[1].to(layout.device))
        anchor = parent if parent is not None else root_key(extra_key)
        loaded.append(pool.commit(block_id, keys[index], parent, tokens, anchor=anchor))
    return loaded


def store_computed(
    pool: BlockPool,
    hit: PrefixHit,
    arena: WorkingCache,
    tokens: list[int],
    reserved: list[int],
    extra_key: bytes,
    measured: list[float | None] | None,
    exact_tokens: int | None = None,
) -> tuple[list[int], BlockKey | None]:
    """Publish the working cache's positions after ``hit.chain`` (``tokens[:arena.num_tokens]``,
    or only its first ``exact_tokens``: keys promise exact K/V) as blocks, the last
    partial if the arena ends mid-block; reserved blocks left over are released.
    Returns the chain covering every computed position (the hit's full blocks, then the
    stored ones; one reference each) and its last key. The hit's tail is not part of
    it: the caller releases it with the rest of the hit.

    ``measured`` (per position of ``tokens``) gives each block its log-probs, and the
    last one the log p of the token after it (``Block.next_logprob``).
    """
    size, num_tokens = pool.block_size, arena.num_tokens
    capped = exact_tokens is not None and exact_tokens < num_tokens
    if capped:
        num_tokens = max(len(hit.chain) * size, exact_tokens)
    first_new = len(hit.chain)
    parent = hit.keys[-1] if hit.keys else None
    new_keys = chain_keys(tokens[:num_tokens], size, extra_key, start_block=first_new, parent=parent)
    stored = first_new + len(new_keys)
    if stored * size < num_tokens:  # the partial tail
        tail_parent = new_keys[-1] if new_keys else (parent if parent is not None else root_key(extra_key))
        new_keys.append(block_key(tail_parent, tokens[stored * size : num_tokens], extra_key))
    targets = reserved[: len(new_keys)]
    arena.store_blocks(pool, first_new, targets)
    after = None
    # the log p of the token after the last block, unless approximate K/V gave it
    if not capped and measured is not None and num_tokens < len(measured) and measured[num_tokens] is not None:
        after = (tokens[num_tokens], measured[num_tokens])
    chain = list(hit.chain)
    for offset, (block_id, key) in enumerate(zip(targets, new_keys, strict=True)):
        index = first_new + offset
        span = slice(index * size, min((index + 1) * size, num_tokens))
        anchor = parent if parent is not None else root_key(extra_key)
        last = offset == len(new_keys) - 1
        chain.append(
            pool.commit(
                block_id,
                key,
                parent,
                tokens[span],
                measured[span] if measured else None,
                anchor=anchor,
                next_logprob=after if last else None,
            )
        )
        parent = key
    pool.release(reserved[len(new_keys) :])
    return chain, parent
