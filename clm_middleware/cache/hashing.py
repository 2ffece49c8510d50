"""Prefix-chained block keys.

A full block's key is ``xxh64(parent_key ‖ token ids ‖ extra key)``. Because the
parent key is inside, a block matches only if every block before it matches too:
the same tokens after a different prefix get a different key. The extra key carries
the model fingerprint (and a tenant salt, where one is set), so blocks computed by
different weights or for different tenants never meet.

Keys are 64-bit; a collision is possible in principle, which is why the pool also
compares the stored token ids and parent key before it calls anything a hit.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockKey = NewType("BlockKey", int)

_ROOT_TAG = b"clm-middleware/block-chain/v1"


def extra_key_bytes(model_fingerprint: str, cache_salt: str | None = None) -> bytes:
    """Bytes mixed into every block key: model fingerprint, then the tenant salt if any."""
    salt = b"" if cache_salt is None else b"\x00salt:" + cache_salt.encode()
    return model_fingerprint.encode() + salt


def root_key(extra_key: bytes) -> BlockKey:
    """The parent key of a chain's first block."""
    return BlockKey(xxhash.xxh64_intdigest(_ROOT_TAG + extra_key))


def block_key(parent: BlockKey, token_ids: Sequence[int], extra_key: bytes) -> BlockKey:
    digest = xxhash.xxh64(parent.to_bytes(8, "little"))
    digest.update(array("I", token_ids).tobytes())
    digest.update(extra_key)
    return BlockKey(digest.intdigest())


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes,
    *,
    start_block: int = 0,
    parent: BlockKey | None = None,
    num_blocks: int | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids``, from ``start_block`` on.

    ``parent`` must be the key of block ``start_block - 1`` when ``start_block > 0``.
    A trailing partial block gets no key: only full blocks are cached.
    """
    if start_block > 0 and parent is None:
        raise RuntimeError("chain_keys: a parent key is required after block 0")
    full_blocks = len(token_ids) // block_size
    stop = full_blocks if num_blocks is None else min(full_blocks, start_block + num_blocks)
    key = root_key(extra_key) if parent is None else parent
    keys: list[BlockKey] = []
    for index in range(start_block, stop):
        key = block_key(key, token_ids[index * block_size : (index + 1) * block_size], extra_key)
        keys.append(key)
    return keys
