"""paged_kv: the model attends over the pool's blocks in place, so the context is held once.

The engine-level contracts (exact reuse, stats, failures, threads, log-probs,
attention) run under both caches in test_engine.py and test_observe.py; these tests
pin what is particular to the paged one.
"""

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.cli.setup import build_engine, sibling_engine
from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.engine.blend import BlendConfig
from clm_middleware.engine.reuse import match_prefix
from clm_middleware.errors import ConfigError

EXACT = 1e-4


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 11 * i) % 250 for i in range(length)]


def paged(tiny_model, tiny_tok, **config) -> Engine:
    return Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_blocks=128, **config), paged_kv=True)


def test_a_paged_request_holds_one_layer_beside_the_pool(tiny_model, tiny_tok):
    engine = paged(tiny_model, tiny_tok)
    arena = Engine(tiny_model, tiny_tok)
    layers = engine.layout.num_layers
    assert engine.working_kv_bytes(160) * layers == arena.working_kv_bytes(160) == 160 * engine.layout.bytes_per_token


def test_extending_a_cached_tail_copies_it_and_never_writes_the_cached_block(tiny_model, tiny_tok):
    engine = paged(tiny_model, tiny_tok)
    first = prompt_of(40)  # two full blocks and an 8-token tail
    engine.generate(first, max_new_tokens=0).result()
    extended = [*first, *prompt_of(5, 3)]
    held = match_prefix(engine.pool, None, extended, engine.extra_key())  # a reader of the tail, meanwhile
    assert held.tail is not None and held.tail_tokens == 8
    tail_before = engine.pool.read_block(held.tail)

    generation = engine.generate(extended, max_new_tokens=3, return_logits=True).result()
    assert generation.stats.cached_tokens == 40
    for before, after in zip(tail_before, engine.pool.read_block(held.tail), strict=True):
        # bit for bit: the block's unwritten rows are uninitialised memory, where a NaN
        # pattern is never equal to itself as a float
        assert torch.equal(before.contiguous().view(torch.uint8), after.contiguous().view(torch.uint8))
    held.release(engine.pool)
    with torch.no_grad():
        reference = tiny_model(torch.tensor([extended])).logits[0, -1]
    assert (generation.logits[0] - reference).abs().max() <= EXACT
    engine.pool.check_invariants()


@pytest.mark.parametrize(("kv_dtype", "bound"), [("bf16", 5e-2), ("fp16", 5e-3)])
def test_a_narrow_pool_under_paged_kv_is_close_to_a_recompute(tiny_model, tiny_tok, kv_dtype, bound):
    engine = paged(tiny_model, tiny_tok, kv_dtype=kv_dtype)
    cached, tail = prompt_of(70), prompt_of(9, offset=4)
    engine.generate(cached, max_new_tokens=0).result()
    generation = engine.generate(cached + tail, max_new_tokens=1, return_logits=True).result()
    assert generation.stats.cached_tokens == 70
    with torch.no_grad():
        reference = tiny_model(torch.tensor([cached + tail])).logits[0, -1]
    assert (generation.logits[0] - reference).abs().max() <= bound


def test_paged_kv_and_approximate_reuse_cannot_be_combined(tiny_model, tiny_tok):
    with pytest.raises(ConfigError, match="paged_kv"):
        Engine(tiny_model, tiny_tok, blend=BlendConfig(), paged_kv=True)


def test_the_cli_engine_and_its_siblings_take_paged_kv():
    engine = build_engine("tiny", paged_kv=True)
    assert engine.paged_kv and sibling_engine(engine).paged_kv
    with pytest.raises(ConfigError, match="paged_kv"):
        build_engine("tiny", paged_kv=True, approximate_reuse=0.15)


def test_a_managed_conversation_under_a_budget_is_the_same_with_either_cache(tiny_model, tiny_tok):
    """Compactions, forced replies and the signals tagger's log-probs: same context,
    same reply likelihoods, same cache figures."""
    runs = {}
    for paged_kv in (False, True):
        engine = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_blocks=256), paged_kv=paged_kv)
        conversation = Conversation(engine, tagging="signals", budget=160, max_new_tokens=6)
        figures = []
        for turn in range(8):
            conversation.add("user", f"Message {turn}: the code is K{turn * 7} and the room is {turn + 3}.")
            stats = conversation.respond(forced_reply=f"Noted, K{turn * 7} for room {turn + 3}.").stats
            figures.append((stats.prompt_tokens, stats.cached_tokens, bool(stats.compaction), stats.reply_nll))
        conversation.add("user", "What was the first code?")
        figures.append(conversation.respond().text)
        runs[paged_kv] = (figures, conversation.context)
        engine.pool.check_invariants()
    (arena_figures, arena_context), (paged_figures, paged_context) = runs[False], runs[True]
    assert paged_context == arena_context
    assert any(compacted for _, _, compacted, _ in arena_figures[:-1])
    for a, p in zip(arena_figures[:-1], paged_figures[:-1], strict=True):
        assert a[:3] == p[:3] and abs(a[3] - p[3]) <= EXACT
    assert paged_figures[-1] == arena_figures[-1]
