"""BlockPool bookkeeping, asserted exactly: refcounts, LRU order, eviction, capacity."""

import contextlib
import random
import threading

import pytest
import torch

from clm_middleware.cache import BlockPool, KVLayout, PoolConfig
from clm_middleware.cache.hashing import block_key, chain_keys, extra_key_bytes, root_key
from clm_middleware.errors import ConfigError, PoolExhaustedError, PoolTooSmallError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
EXTRA = extra_key_bytes("test-model")
SIZE = 4


def make_pool(num_blocks: int = 8) -> BlockPool:
    return BlockPool(LAYOUT, PoolConfig(block_size=SIZE, max_blocks=num_blocks))


def store(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and commit the full blocks of ``tokens`` (as the engine does); returns the chain."""
    keys = chain_keys(tokens, SIZE, EXTRA)
    blocks = pool.allocate(len(keys))
    chain, parent = [], None
    for index, (block_id, key) in enumerate(zip(blocks, keys, strict=True)):
        chain.append(pool.commit(block_id, key, parent, tokens[index * SIZE : (index + 1) * SIZE]))
        parent = key
    return chain


def match(pool: BlockPool, tokens: list[int]) -> list[int]:
    return pool.match(chain_keys(tokens, SIZE, EXTRA), tokens)


def store_with_tail(pool: BlockPool, tokens: list[int], extra: bytes = EXTRA) -> list[int]:
    """Commit every token of ``tokens``, the last block partial (as the engine stores a turn)."""
    keys = chain_keys(tokens, SIZE, extra)
    if len(tokens) % SIZE:
        keys.append(block_key(keys[-1] if keys else root_key(extra), tokens[len(keys) * SIZE :], extra))
    chain, parent = [], None
    for index, (block_id, key) in enumerate(zip(pool.allocate(len(keys)), keys, strict=True)):
        anchor = parent if parent is not None else root_key(extra)
        chain.append(pool.commit(block_id, key, parent, tokens[index * SIZE : (index + 1) * SIZE], anchor=anchor))
        parent = key
    return chain


def match_with_tail(pool: BlockPool, tokens: list[int], extra: bytes = EXTRA) -> tuple[list[int], int]:
    """Full blocks, then the tail lookup (as the engine matches); the blocks and tokens served."""
    keys = chain_keys(tokens, SIZE, extra, num_blocks=(len(tokens) - 1) // SIZE)
    chain = pool.match(keys, tokens)
    anchor = keys[len(chain) - 1] if chain else root_key(extra)
    tail = pool.match_tail(anchor, tokens[len(chain) * SIZE :], len(tokens) - 1 - len(chain) * SIZE)
    return (chain, len(chain) * SIZE) if tail is None else ([*chain, tail[0]], len(chain) * SIZE + tail[1])


def test_allocate_takes_free_blocks_in_order_with_refcount_one():
    pool = make_pool()
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts([0, 1, 2]) == [1, 1, 1]
    stats = pool.stats()
    assert (stats.blocks_in_use, stats.blocks_free, stats.blocks_cached_free) == (3, 5, 0)
    pool.check_invariants()


def test_released_chain_enters_lru_tail_first_so_prefix_survives_longest():
    pool = make_pool()
    chain = store(pool, list(range(12)))
    pool.release(list(reversed(chain)))
    assert pool.lru_order() == [2, 1, 0]
    assert pool.stats().blocks_cached_free == 3
    pool.check_invariants()


def test_match_acquires_cached_blocks_and_removes_them_from_the_lru():
    pool = make_pool()
    chain = store(pool, list(range(12)))
    pool.release(list(reversed(chain)))
    assert match(pool, [*range(8), 99, 98, 97, 96]) == [0, 1]
    assert pool.ref_counts([0, 1, 2]) == [1, 1, 0]
    assert pool.lru_order() == [2]
    assert pool.stats().hit_blocks == 2
    pool.check_invariants()


def test_shared_prefix_is_counted_by_refcount():
    pool = make_pool()
    chain = store(pool, list(range(8)))
    assert match(pool, list(range(8))) == chain
    assert pool.ref_counts(chain) == [2, 2]
    pool.release(list(reversed(chain)))
    assert pool.ref_counts(chain) == [1, 1]
    assert pool.lru_order() == []


def test_eviction_happens_only_when_room_is_needed_and_takes_the_lru_head():
    pool = make_pool(num_blocks=4)
    first = store(pool, list(range(8)))  # blocks 0, 1
    pool.release(list(reversed(first)))  # LRU: 1, 0
    assert pool.allocate(2) == [2, 3]  # free blocks first: nothing evicted
    assert pool.stats().evictions == 0
    assert pool.allocate(1) == [1]  # now the LRU head (the chain's tail block) goes
    assert pool.stats().evictions == 1
    assert match(pool, list(range(8))) == [0]  # the prefix block still hits
    pool.check_invariants()


def test_hit_is_confirmed_by_token_ids_so_a_key_collision_is_a_miss():
    pool = make_pool()
    tokens = list(range(4))
    key = chain_keys(tokens, SIZE, EXTRA)[0]
    [block_id] = pool.allocate(1)
    pool.commit(block_id, key, None, [7, 7, 7, 7])  # same key, different content
    pool.release([block_id])
    assert pool.match([key], tokens) == []
    assert pool.ref_counts([block_id]) == [0]


def test_commit_of_an_existing_key_returns_the_cached_block_and_frees_the_new_one():
    pool = make_pool()
    [original] = store(pool, list(range(4)))
    [duplicate] = pool.allocate(1)
    key = chain_keys(list(range(4)), SIZE, EXTRA)[0]
    assert pool.commit(duplicate, key, None, list(range(4))) == original
    assert pool.ref_counts([original, duplicate]) == [2, 0]
    assert pool.stats().blocks_free == 7
    pool.check_invariants()


def test_exhaustion_raises_a_clear_error_and_changes_nothing():
    pool = make_pool(num_blocks=4)
    held = pool.allocate(3)
    with pytest.raises(PoolExhaustedError, match=r"cannot supply 2 blocks.*3 are held"):
        pool.allocate(2)
    assert pool.ref_counts(held) == [1, 1, 1]
    assert pool.stats().blocks_free == 1
    pool.check_invariants()


def test_a_request_larger_than_the_whole_pool_is_too_small_not_busy():
    pool = make_pool(num_blocks=4)
    asked = []
    pool.add_pressure_listener(asked.append)
    with pytest.raises(PoolTooSmallError, match=r"needs 5 KV blocks of 4 tokens; the pool has 4 in all"):
        pool.allocate(5)
    assert asked == []  # nobody is asked to give back room that could never be enough
    assert pool.stats().blocks_free == 4


def test_a_short_allocation_asks_pressure_listeners_in_order_until_there_is_room():
    pool = make_pool(num_blocks=4)
    first, second = pool.allocate(2), pool.allocate(2)
    asked = []

    def give_back(blocks: list[int], name: str):
        def listener(needed: int) -> None:
            asked.append((name, needed))
            pool.release(blocks)

        return listener

    pool.add_pressure_listener(give_back(first, "first"))
    pool.add_pressure_listener(give_back(second, "second"))
    assert len(pool.allocate(2)) == 2
    assert asked == [("first", 2)]  # the first one made the room: the second is not asked
    pool.check_invariants()


def test_a_removed_pressure_listener_is_not_asked_and_a_short_pool_still_raises():
    pool = make_pool(num_blocks=4)
    held = pool.allocate(4)
    asked = []
    pool.add_pressure_listener(asked.append)
    with pytest.raises(PoolExhaustedError, match="held by running requests and open conversations"):
        pool.allocate(1)
    assert asked == [1]
    pool.remove_pressure_listener(asked.append)
    pool.remove_pressure_listener(asked.append)  # one never added (any more) is ignored
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    assert asked == [1]
    assert pool.ref_counts(held) == [1, 1, 1, 1]


def test_work_called_soon_runs_at_the_next_allocation_outside_the_lock():
    pool = make_pool(num_blocks=4)
    held = pool.allocate(4)
    pool.call_soon(lambda: pool.release(held))  # as a finalizer would: not now
    assert pool.stats().blocks_free == 0
    assert len(pool.allocate(2)) == 2  # ran first, so the room is there
    pool.check_invariants()


def test_release_of_an_unreferenced_block_is_a_caller_bug():
    pool = make_pool()
    with pytest.raises(RuntimeError):
        pool.release([0])


def test_capacity_by_blocks_bytes_or_the_smaller_of_both():
    block_bytes = LAYOUT.bytes_per_token * SIZE
    assert make_pool(1).num_blocks == 1
    by_bytes = BlockPool(LAYOUT, PoolConfig(block_size=SIZE, max_kv_bytes=block_bytes * 5 + 1))
    assert by_bytes.num_blocks == 5
    both = BlockPool(LAYOUT, PoolConfig(block_size=SIZE, max_blocks=3, max_kv_bytes=block_bytes * 5))
    assert both.num_blocks == 3
    with pytest.raises(ConfigError, match="max_kv_bytes"):
        BlockPool(LAYOUT, PoolConfig(block_size=SIZE, max_kv_bytes=block_bytes - 1))
    with pytest.raises(ConfigError, match="block_size"):
        PoolConfig(block_size=0)


@pytest.mark.parametrize("tails", [False, True], ids=["full-blocks", "with-partial-tails"])
def test_random_operation_sequences_keep_every_invariant(tails):
    rng = random.Random(int(tails))
    pool = make_pool(num_blocks=6)
    held: list[list[int]] = []
    for _ in range(500):
        action = rng.random()
        length = rng.randint(1, 11) if tails else rng.choice([4, 8, 12])
        tokens = [rng.randrange(2 if tails else 3) for _ in range(length)]
        if action < 0.4 and pool.can_allocate(-(-len(tokens) // SIZE)):
            held.append(store_with_tail(pool, tokens) if tails else store(pool, tokens))
        elif action < 0.7:
            held.append(match_with_tail(pool, tokens)[0] if tails else match(pool, tokens))
        elif held:
            pool.release(list(reversed(held.pop(rng.randrange(len(held))))))
        pool.check_invariants()
    for chain in held:
        pool.release(list(reversed(chain)))
    assert pool.stats().blocks_in_use == 0


def test_concurrent_store_match_release_keeps_every_invariant():
    pool = make_pool(num_blocks=64)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                tokens = [rng.randrange(2) for _ in range(8)]
                chain = match(pool, tokens)
                pool.release(list(reversed(chain)))
                if pool.can_allocate(2):
                    with contextlib.suppress(PoolExhaustedError):  # another thread took the room
                        pool.release(list(reversed(store(pool, tokens))))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_a_block_keeps_the_log_probs_measured_for_it_and_fills_its_gaps_from_a_second_commit():
    pool = make_pool(2)
    key = chain_keys([1, 2, 3, 4], SIZE, EXTRA)[0]
    first = pool.allocate(1)[0]
    assert pool.commit(first, key, None, [1, 2, 3, 4], [None, -1.0, None, None]) == first
    second = pool.allocate(1)[0]
    assert pool.commit(second, key, None, [1, 2, 3, 4], [None, -1.0, -2.0, None]) == first  # same key: one block
    assert pool.logprobs([first]) == [(None, -1.0, -2.0, None)]
    pool.release([first, first])
    other = pool.allocate(2)  # pressure evicts the cached block: its log-probs go with it
    assert first in other and pool.logprobs([first]) == [None]


def test_a_partial_tail_serves_every_token_of_a_prompt_that_extends_it():
    pool = make_pool()
    chain = store_with_tail(pool, list(range(10)))  # blocks 0, 1 full; block 2 holds tokens 8, 9
    pool.release(list(reversed(chain)))
    assert match_with_tail(pool, [*range(10), 50, 51]) == (chain, 10)
    assert pool.ref_counts(chain) == [1, 1, 1]
    pool.check_invariants()


def test_a_block_serves_its_leading_tokens_to_a_prompt_that_diverges_inside_it():
    pool = make_pool()
    chain = store_with_tail(pool, list(range(12)))
    pool.release(list(reversed(chain)))
    assert match_with_tail(pool, [*range(10), 77, 78]) == (chain, 10)  # 2 of block 2's 4 tokens
    pool.check_invariants()


def test_a_tail_hit_always_leaves_the_last_prompt_token_to_compute():
    pool = make_pool()
    chain = store_with_tail(pool, list(range(10)))
    pool.release(list(reversed(chain)))
    served, tokens = match_with_tail(pool, list(range(10)))
    assert tokens == 9 and served == chain


def test_a_partial_tail_is_never_served_after_another_prefix_or_to_another_tenant():
    pool = make_pool()
    first, tail = store_with_tail(pool, [*range(4), 8, 9])
    pool.release([tail, first])
    served, tokens = match_with_tail(pool, [*range(3), 99, 8, 9, 10])  # block 0 diverges after 3 tokens
    assert (served, tokens) == ([first], 3)  # its leading tokens serve; the tail [8 9] after it never
    pool.release(served)
    assert match_with_tail(pool, [*range(4), 8, 9, 10], extra_key_bytes("test-model", "tenant-b")) == ([], 0)
    assert pool.ref_counts([first, tail]) == [0, 0]
    pool.check_invariants()


def test_a_tail_made_redundant_by_a_longer_sibling_is_freed_not_cached():
    pool = make_pool()
    first = store_with_tail(pool, list(range(6)))  # [0 1 2 3] + tail [4 5]
    pool.release(list(reversed(first)))
    hit, _ = match_with_tail(pool, list(range(9)))  # a turn extends the tail
    extended = store_with_tail(pool, list(range(9)))  # [0 1 2 3] [4 5 6 7] + tail [8]
    assert pool.block(first[1]).key is not None  # still held by the extending turn
    pool.release(list(reversed(hit)))  # its last reference goes: [4 5] serves nothing [4 5 6 7] cannot
    assert pool.block(first[1]).key is None and pool.stats().blocks_cached_free == 0
    pool.release(list(reversed(extended)))
    assert pool.stats().blocks_cached_free == 3
    pool.check_invariants()


def test_an_unreferenced_tail_is_freed_as_soon_as_a_longer_sibling_is_committed():
    pool = make_pool()
    tail = store_with_tail(pool, list(range(6)))[1]
    pool.release([tail])  # cached-free, then the same prefix grows elsewhere
    store_with_tail(pool, list(range(8)))
    assert pool.block(tail).key is None and tail not in pool.lru_order()
    pool.check_invariants()
