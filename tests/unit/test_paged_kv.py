"""paged_kv: the model attends over the pool's blocks in place, so the context is held once.

The engine-level contracts (exact reuse, stats, failures, threads, log-probs,
attention) run under both caches in test_engine.py and test_observe.py; these tests
pin what is particular to the paged one.
"""

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.cache import paged as paged_module
from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.layout import KVLayout
from clm_middleware.cache.paged import PAST_TILE_TOKENS, PagedCache
from clm_middleware.cli.setup import build_engine, sibling_engine
from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.engine import attention as attention_module
from clm_middleware.engine.blend import BlendConfig
from clm_middleware.engine.reuse import match_prefix
from clm_middleware.errors import ConfigError

EXACT = 1e-4


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 11 * i) % 250 for i in range(length)]


def paged(tiny_model, tiny_tok, **config) -> Engine:
    return Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_blocks=128, **config), paged_kv=True)


def test_a_paged_request_holds_one_tile_of_one_layer_beside_the_pool(tiny_model, tiny_tok):
    engine = paged(tiny_model, tiny_tok)
    arena = Engine(tiny_model, tiny_tok)
    layer_bytes = engine.layout.bytes_per_token // engine.layout.num_layers  # per position, model dtype
    assert engine.attends_in_place
    assert arena.working_kv_bytes(3000) == 3000 * engine.layout.bytes_per_token
    assert engine.working_kv_bytes(160) == 160 * layer_bytes
    assert engine.working_kv_bytes(3000) == PAST_TILE_TOKENS * layer_bytes  # bounded, whatever the context
    assert engine.working_kv_bytes(3000, pooled=False) == 3000 * engine.layout.bytes_per_token  # an arena


def test_a_stateless_replay_on_a_paged_engine_reports_the_arena_it_runs_in(tiny_model, tiny_tok):
    from clm_middleware.render import ChatFormat
    from clm_middleware.replay.runner import PlainChatDriver, ReplayOptions
    from clm_middleware.replay.transcript import Message

    engine = paged(tiny_model, tiny_tok)
    driver = PlainChatDriver(
        engine, ChatFormat.from_tokenizer(tiny_tok), ReplayOptions(mode="stateless", teacher_force=True), "c"
    )
    driver.add(Message(role="user", content="Which room is the code K7 for?"))
    record = driver.respond(Message(role="assistant", content="Room 3."))
    positions = record.prompt_tokens + record.forced_tokens
    assert record.working_kv_bytes == positions * engine.layout.bytes_per_token
    assert record.live_kv_bytes == 0


def test_without_the_engines_attention_a_paged_request_gathers_one_layer(tiny_model, tiny_tok):
    engine = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_blocks=128), paged_kv=True, gqa_attention=False)
    assert not engine.attends_in_place
    assert engine.working_kv_bytes(3000) * engine.layout.num_layers == 3000 * engine.layout.bytes_per_token
    cached, tail = prompt_of(70), prompt_of(9, offset=4)
    engine.generate(cached, max_new_tokens=0).result()
    generation = engine.generate(cached + tail, max_new_tokens=1, return_logits=True).result()
    with torch.no_grad():
        reference = tiny_model(torch.tensor([cached + tail])).logits[0, -1]
    assert (generation.logits[0] - reference).abs().max() <= EXACT


@pytest.mark.parametrize("kv_dtype", [None, "fp16"])
def test_past_tiles_are_the_positions_kv_in_order_over_scattered_and_consecutive_blocks(
    tiny_model, tiny_tok, monkeypatch, kv_dtype
):
    """Stored at the model's dtype, a run of consecutive blocks a tile long is one view of
    the pool, however long, and shorter runs are copied together; narrower storage is
    widened in copies of at most a tile (three blocks here)."""
    monkeypatch.setattr(paged_module, "PAST_TILE_TOKENS", 48)  # three blocks a copy
    config = {"kv_dtype": kv_dtype} if kv_dtype else {}
    pool = BlockPool(KVLayout.from_model(tiny_model), PoolConfig(max_blocks=16, **config))
    table = [0, 1, 2, 3, 9, 10, 4, 12]  # fp32: view [0-3], copy [9 10 4], view [12]; fp16: copies
    blocks = pool.allocate(13)
    generator = torch.Generator().manual_seed(0)
    layers, heads, dim = pool.layout.num_layers, pool.layout.num_kv_heads, pool.layout.head_dim
    for block in blocks:
        pool.write_block(block, *(torch.randn(layers, heads, 16, dim, generator=generator) for _ in range(2)))
    cache = PagedCache(pool, table, num_tokens=120, writable_from=128, attend_in_place=True)
    for layer in range(layers):
        tiles = list(cache.past_tiles(layer, 117, torch.float32))
        pool_keys, pool_values = pool.layer_storage(layer)
        if kv_dtype is None:
            assert [k.shape[2] for k, _ in tiles] == [64, 48, 5]
            views = [k.untyped_storage().data_ptr() == pool_keys.untyped_storage().data_ptr() for k, _ in tiles]
            assert views == [True, False, True]
        else:
            assert [k.shape[2] for k, _ in tiles] == [48, 48, 21]
        keys = torch.cat([k for k, _ in tiles], dim=2)[0]
        values = torch.cat([v for _, v in tiles], dim=2)[0]
        assert torch.equal(keys, pool_keys[:, table].flatten(1, 2)[:, :117].float())
        assert torch.equal(values, pool_values[:, table].flatten(1, 2)[:, :117].float())
        assert torch.equal(keys, cache.layer_keys(layer)[:, :117])


def test_a_position_bias_takes_the_general_attention_over_the_gathered_paged_past(tiny_model, monkeypatch):
    """Tiles have no bias term: with one, the past is gathered whole for transformers'
    SDPA path; a zero bias gives the tiled output."""
    from clm_middleware.engine.attention import PAGED_CACHE_KWARG, sdpa_gqa_forward

    monkeypatch.setattr(paged_module, "PAST_TILE_TOKENS", 32)
    pool = BlockPool(KVLayout.from_model(tiny_model), PoolConfig(max_blocks=16))
    generator = torch.Generator().manual_seed(1)
    layout = pool.layout
    blocks = pool.allocate(9)
    for block in blocks:
        shape = (layout.num_layers, layout.num_kv_heads, 16, layout.head_dim)
        pool.write_block(block, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    cache = PagedCache(pool, [0, 3, 1, 2, 8, 7, 4, 5, 6], num_tokens=100, writable_from=144, attend_in_place=True)
    module = tiny_model.model.layers[0].self_attn
    past, fresh = 100, 5
    heads = tiny_model.config.num_attention_heads
    query = torch.randn(1, heads, fresh, layout.head_dim, generator=generator)
    keys, values = (torch.randn(1, layout.num_kv_heads, fresh, layout.head_dim, generator=generator) for _ in range(2))
    mask = torch.ones(fresh, past + fresh, dtype=torch.bool).tril(past)[None, None]

    def attend(**extra):
        cache.expect_past_read(0, past)
        output, _ = sdpa_gqa_forward(
            module, query, keys, values, mask, scaling=module.scaling, **{PAGED_CACHE_KWARG: cache}, **extra
        )
        return output

    tiled = attend()
    general = attend(position_bias=torch.zeros(1, heads, fresh, past + fresh))
    assert (general - tiled).abs().max() <= 1e-5
    cache.check_past_read()  # every expected past was taken


@pytest.mark.parametrize("kv_dtype", [None, "fp16"])
def test_in_place_attention_over_many_tiles_gives_the_gathered_logits_and_tokens(
    tiny_model, tiny_tok, monkeypatch, kv_dtype
):
    """One block per copy: in an fp16 pool a 70-token hit is read as five tiles, merged
    three parts at a time (in an fp32 pool, as views of its runs of consecutive blocks),
    in the prefill after the hit and in every decode step; the gathered path is the
    reference."""
    monkeypatch.setattr(paged_module, "PAST_TILE_TOKENS", 16)
    monkeypatch.setattr(attention_module, "MERGE_PARTS", 3)
    config = {"kv_dtype": kv_dtype} if kv_dtype else {}
    runs = []
    for gqa_attention in (True, False):
        engine = Engine(
            tiny_model,
            tiny_tok,
            pool_config=PoolConfig(max_blocks=128, **config),
            paged_kv=True,
            gqa_attention=gqa_attention,
        )
        assert engine.attends_in_place == gqa_attention
        cached, tail = prompt_of(70), prompt_of(9, offset=4)
        engine.generate(cached, max_new_tokens=0).result()
        generation = engine.generate(cached + tail, max_new_tokens=6, return_logits=True).result()
        assert generation.stats.cached_tokens == 70
        runs.append(generation)
        engine.pool.check_invariants()
    in_place, gathered = runs
    assert in_place.token_ids == gathered.token_ids
    assert max(float((a - b).abs().max()) for a, b in zip(in_place.logits, gathered.logits, strict=True)) <= EXACT


@pytest.mark.parametrize("architecture", ["qwen2", "mistral", "qwen3"])
def test_other_llama_family_models_attend_in_place_as_their_forward(
    architecture, tiny_tok, tiny_family_model, monkeypatch
):
    """The cache reaches the attention through the forward's kwargs in every family."""
    monkeypatch.setattr(paged_module, "PAST_TILE_TOKENS", 16)
    model = tiny_family_model(architecture)
    engine = Engine(model, tiny_tok, pool_config=PoolConfig(max_blocks=64), paged_kv=True)
    assert engine.attends_in_place
    cached, tail = prompt_of(40, offset=7), prompt_of(5, offset=1)
    engine.generate(cached, max_new_tokens=0).result()
    generation = engine.generate(cached + tail, max_new_tokens=4, return_logits=True).result()
    assert generation.stats.cached_tokens == 40
    with torch.no_grad():
        context = cached + tail + generation.token_ids[:-1]
        reference = model(torch.tensor([context])).logits[0, len(cached) + len(tail) - 1 :]
    assert max(float((a - b).abs().max()) for a, b in zip(generation.logits, reference, strict=True)) <= EXACT


def test_an_attention_that_never_reads_the_paged_past_fails_the_call(tiny_tok):
    """A model switched to another attention after the engine was built would attend to
    the fresh positions alone (one new position: no mask to trip over), so the call
    fails instead of answering from them."""
    from clm_middleware.models.tiny import tiny_llama

    model = tiny_llama(seed=3)
    engine = Engine(model, tiny_tok, pool_config=PoolConfig(max_blocks=64), paged_kv=True)
    cached = prompt_of(40)
    engine.generate(cached, max_new_tokens=0).result()
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="never read the paged cache's past"):
        engine.generate([*cached, 5], max_new_tokens=1).result()
    engine.pool.check_invariants()


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
