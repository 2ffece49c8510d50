"""The block-pool KV cache: keys, layout, pool."""

from clm_middleware.cache.block_pool import Block, BlockPool, PoolStats
from clm_middleware.cache.hashing import BlockKey, block_key, chain_keys, extra_key_bytes, root_key
from clm_middleware.cache.layout import BLOCK_SIZE, KVLayout, PoolConfig

__all__ = [
    "BLOCK_SIZE",
    "Block",
    "BlockKey",
    "BlockPool",
    "KVLayout",
    "PoolConfig",
    "PoolStats",
    "block_key",
    "chain_keys",
    "extra_key_bytes",
    "root_key",
]
