"""Approximate reuse after a compaction (engine/blend.py): opt-in, labelled, never stored as exact."""

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cli.setup import build_engine, sibling_engine
from clm_middleware.engine import Engine
from clm_middleware.engine.blend import BlendConfig, Blender, matching_runs, observed_from
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.reuse import match_prefix
from clm_middleware.errors import ConfigError
from clm_middleware.models import tiny_llama

EXACT = 1e-4


def text(length: int, seed: int) -> list[int]:
    return [(seed * 31 + 13 * i) % 250 for i in range(length)]


PREFIX, OLD_DIGEST, NEW_DIGEST = text(40, 1), text(50, 2), text(20, 3)
KEPT, NEW_MESSAGE = text(60, 4) + text(45, 5), text(10, 6)
BEFORE = PREFIX + OLD_DIGEST + KEPT  # the previous turn's context
AFTER = PREFIX + NEW_DIGEST + KEPT + NEW_MESSAGE  # a compaction rewrote the digest; the kept text moved


@pytest.fixture(scope="module")
def deep_model():
    """Six layers: with the tiny model's two, the check pass (layers 0-1) recomputes everything."""
    return tiny_llama(num_layers=6)


def blending(model, tokenizer, share: float) -> Engine:
    return Engine(model, tokenizer, pool_config=PoolConfig(max_blocks=128), blend=BlendConfig(recompute_share=share))


def recomputed_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


def after_compaction(engine: Engine):
    engine.generate(BEFORE, max_new_tokens=0).result()
    return engine.generate(AFTER, max_new_tokens=1, return_logits=True).result()


def test_runs_are_the_retained_text_in_order_and_short_coincidences_are_not():
    runs = matching_runs(BEFORE, 40, AFTER, 40, len(AFTER) - 1, min_run=16)
    assert [(r.new_start, r.old_start, r.length) for r in runs] == [(60, 90, len(KEPT))]
    assert matching_runs(BEFORE, 40, AFTER, 40, len(AFTER) - 1, min_run=len(KEPT) + 1) == []


def test_moved_keys_equal_keys_computed_at_the_new_positions(deep_model, tiny_tok):
    engine = Engine(deep_model, tiny_tok)
    blender = Blender(deep_model, BlendConfig())
    tokens = text(24, 7)
    for old_start, new_start in ((40, 10), (10, 40)):  # moved back (a drop) and forward (a longer digest)
        moved = ArenaCache(engine.layout, capacity_blocks=8, block_size=16)
        computed = ArenaCache(engine.layout, capacity_blocks=8, block_size=16)
        for arena, start in ((moved, old_start), (computed, new_start)):
            arena.reset_to(start)
            blender._forward(arena, tokens, list(range(start, start + len(tokens))), start + len(tokens))
        old = torch.arange(old_start, old_start + len(tokens))
        new = torch.arange(new_start, new_start + len(tokens))
        blender._move(moved, old, new)
        # layer 0 sees only the token and its position: moving must give what computing there gives
        assert torch.allclose(moved.flat_keys[0][:, new], computed.flat_keys[0][:, new], atol=EXACT)
        assert torch.equal(moved.flat_values[0][:, new], computed.flat_values[0][:, new])


def test_recomputing_every_moved_token_gives_the_exact_logits(deep_model, tiny_tok):
    generation = after_compaction(blending(deep_model, tiny_tok, share=1.0))
    assert (generation.logits[0] - recomputed_logits(deep_model, AFTER)).abs().max() <= EXACT
    assert generation.stats.approximate_tokens == 0
    assert generation.stats.cached_tokens == len(PREFIX)


def test_a_blend_reuses_the_moved_text_and_says_how_much_is_approximate(deep_model, tiny_tok):
    exact = Engine(deep_model, tiny_tok, pool_config=PoolConfig(max_blocks=128))
    exact_stats = after_compaction(exact).stats
    generation = after_compaction(blending(deep_model, tiny_tok, share=0.2))
    stats = generation.stats
    moved = len(KEPT)
    recomputed = -(-moved // 5)  # ceil(0.2 × moved)
    assert stats.approximate_tokens == moved - recomputed
    assert stats.cached_tokens == len(PREFIX) + moved - recomputed
    assert stats.prefill_tokens == exact_stats.prefill_tokens - stats.approximate_tokens
    assert stats.cached_tokens + stats.prefill_tokens == stats.prompt_tokens
    assert stats.blend_check_tokens == len(AFTER) - 1 - len(PREFIX)
    difference = (generation.logits[0] - recomputed_logits(deep_model, AFTER)).abs().max()
    assert 0 < difference < 1.0  # approximate, and near: the check layers and the new text are exact


def test_approximate_kv_never_reaches_the_pool(deep_model, tiny_tok):
    engine = blending(deep_model, tiny_tok, share=0.2)
    generation = after_compaction(engine)
    assert generation.stats.approximate_tokens > 0
    engine.pool.check_invariants()
    stored = match_prefix(engine.pool, None, [*AFTER, 1], engine.extra_key())
    assert stored.start <= len(AFTER) - 1 - generation.stats.approximate_tokens  # the exact part only
    # an exact engine on the same pool is served what is stored, and gets the exact logits
    exact = Engine(deep_model, tiny_tok, pool=engine.pool)
    again = exact.generate(AFTER, max_new_tokens=1, return_logits=True).result()
    assert again.stats.approximate_tokens == 0
    assert (again.logits[0] - recomputed_logits(deep_model, AFTER)).abs().max() <= EXACT


def test_the_next_turn_continues_from_the_blended_context(deep_model, tiny_tok):
    engine = blending(deep_model, tiny_tok, share=0.2)
    first = after_compaction(engine)
    follow = AFTER + first.token_ids + text(12, 8)
    generation = engine.generate(follow, max_new_tokens=1).result()
    assert generation.stats.prefill_tokens == 12 + 1  # the new text and the reply token never fed back
    # from the first moved position on, everything was computed after approximate K/V
    moved_from = len(PREFIX) + len(NEW_DIGEST)
    assert first.stats.approximate_tokens + len(NEW_MESSAGE) <= generation.stats.approximate_tokens
    assert generation.stats.approximate_tokens <= len(AFTER) - moved_from
    engine.pool.check_invariants()


def test_an_exact_engine_never_serves_what_a_blend_left_in_an_arena(deep_model, tiny_tok):
    engine = blending(deep_model, tiny_tok, share=0.2)
    after_compaction(engine)
    engine.blend, engine.runner.blender = None, None  # the same arenas, no longer opted in
    generation = engine.generate(AFTER, max_new_tokens=1, return_logits=True).result()
    assert generation.stats.approximate_tokens == 0
    assert (generation.logits[0] - recomputed_logits(deep_model, AFTER)).abs().max() <= EXACT


def test_nothing_moves_when_no_run_is_long_enough(deep_model, tiny_tok):
    engine = Engine(deep_model, tiny_tok, blend=BlendConfig(min_run_tokens=len(KEPT) + 1))
    generation = after_compaction(engine)
    assert generation.stats.approximate_tokens == 0 and generation.stats.blend_check_tokens == 0
    assert (generation.logits[0] - recomputed_logits(deep_model, AFTER)).abs().max() <= EXACT


def test_observed_positions_are_always_computed_exactly():
    assert observed_from(Observe(), 100) == 99
    assert observed_from(Observe(logprobs=True), 100) == 0  # every position scored: nothing to blend
    assert observed_from(Observe(logprobs=True, logprob_positions=frozenset({70, 80})), 100) == 69
    assert observed_from(Observe(attention_window=30), 100) == 70
    assert observed_from(Observe(attention_window=300), 100) == 0


def test_a_scored_turn_blends_only_before_what_it_scores(deep_model, tiny_tok):
    engine = blending(deep_model, tiny_tok, share=0.2)
    engine.generate(BEFORE, max_new_tokens=0).result()
    scored = frozenset(range(len(AFTER) - len(NEW_MESSAGE), len(AFTER)))
    observe = Observe(logprobs=True, logprob_positions=scored)
    generation = engine.generate(AFTER, max_new_tokens=1, observe=observe).result()
    exact = Engine(deep_model, tiny_tok).generate(AFTER, max_new_tokens=1, observe=observe).result()
    assert generation.stats.approximate_tokens > 0
    assert all(generation.prompt_logprobs[q] is not None for q in scored)
    assert [q for q, v in enumerate(generation.prompt_logprobs) if v is not None] == [
        q for q, v in enumerate(exact.prompt_logprobs) if v is not None
    ]


def test_blend_settings_are_checked_and_named():
    for field, value in (("recompute_share", 1.5), ("min_run_tokens", 0), ("check_layer", -1)):
        with pytest.raises(ConfigError, match=field):
            BlendConfig(**{field: value})


def test_a_model_without_rotary_positions_is_refused():
    with pytest.raises(ConfigError, match="rotary"):
        Blender(torch.nn.Linear(2, 2), BlendConfig())


def test_the_cli_engine_takes_approximate_reuse_and_siblings_keep_it():
    engine = build_engine("tiny", approximate_reuse=0.3)
    assert engine.blend == BlendConfig(recompute_share=0.3)
    assert sibling_engine(engine).blend == engine.blend
    assert build_engine("tiny").blend is None
    with pytest.raises(ConfigError, match="approximate_reuse"):
        build_engine("tiny", approximate_reuse=0.3, engine_url="openai:http://127.0.0.1:9")


def test_a_blended_context_outgrowing_its_arena_moves_with_it(deep_model, tiny_tok):
    engine = blending(deep_model, tiny_tok, share=0.2)
    first = after_compaction(engine)
    follow = AFTER + first.token_ids + text(12, 8)
    # room for 600 more tokens: past the first arena's 512 positions, so a larger one is taken
    generation = engine.generate(follow, max_new_tokens=600, stop_token_ids=[]).result()
    assert generation.stats.prefill_tokens == 12 + 1
    assert generation.stats.approximate_tokens > 0
    engine.pool.check_invariants()


def test_the_check_pass_computes_the_first_layers_exactly(deep_model, tiny_tok):
    engine = Engine(deep_model, tiny_tok)
    blender = Blender(deep_model, BlendConfig(check_layer=1))
    exact = ArenaCache(engine.layout, capacity_blocks=16, block_size=16)
    checked = ArenaCache(engine.layout, capacity_blocks=16, block_size=16)
    blender._forward(exact, AFTER, list(range(len(AFTER))), len(AFTER))
    blender._forward(checked, PREFIX, list(range(len(PREFIX))), len(PREFIX))
    blender._first_layers(checked, AFTER, len(PREFIX), len(AFTER))
    span = slice(len(PREFIX), len(AFTER))
    for layer in (0, 1):
        assert torch.allclose(checked.flat_keys[layer][:, span], exact.flat_keys[layer][:, span], atol=1e-5)
        assert torch.allclose(checked.flat_values[layer][:, span], exact.flat_values[layer][:, span], atol=1e-5)
    assert not torch.allclose(checked.flat_keys[2][:, span], exact.flat_keys[2][:, span], atol=1e-3)  # left alone
