"""PoolConfig.kv_dtype: narrower pool storage, labelled approximate, never mixed with exact blocks."""

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.cli.setup import build_engine
from clm_middleware.engine import Engine
from clm_middleware.errors import ConfigError

EXACT = 1e-4


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 13 * i) % 250 for i in range(length)]


def hit_logits(engine: Engine, cached: list[int], tail: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of ``cached + tail`` with ``cached`` gathered from the pool (not from a spare arena)."""
    engine.generate(cached, max_new_tokens=0).result()
    engine.runner.arenas = type(engine.runner.arenas)(engine.layout, engine.block_size)  # no arena holds it: gather
    generation = engine.generate(cached + tail, max_new_tokens=1, return_logits=True).result()
    return generation.logits[0], generation.stats.cached_tokens


def test_a_half_precision_pool_holds_twice_the_blocks_in_the_same_bytes(tiny_model, tiny_tok):
    budget = 64 * Engine(tiny_model, tiny_tok).pool.block_bytes
    exact = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_kv_bytes=budget))
    for name in ("bf16", "fp16", "bfloat16", "float16"):
        half = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_kv_bytes=budget, kv_dtype=name))
        assert half.pool.num_blocks == 2 * exact.pool.num_blocks == 128
        assert half.pool.block_bytes * 2 == exact.pool.block_bytes
        assert not half.pool.exact and exact.pool.exact


@pytest.mark.parametrize(("kv_dtype", "bound"), [(None, EXACT), ("bf16", 5e-2), ("fp16", 5e-3)])
def test_a_hit_from_a_narrow_pool_is_close_to_a_recompute_and_exact_only_at_the_models_dtype(
    tiny_model, tiny_tok, kv_dtype, bound
):
    engine = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(max_blocks=64, kv_dtype=kv_dtype))
    cached, tail = prompt_of(70), prompt_of(9, offset=4)
    logits, served = hit_logits(engine, cached, tail)
    assert served == 70
    with torch.no_grad():
        reference = tiny_model(torch.tensor([cached + tail])).logits[0, -1]
    assert (logits - reference).abs().max() <= bound
    engine.pool.check_invariants()


def test_an_unknown_kv_dtype_names_the_field():
    with pytest.raises(ConfigError, match="kv_dtype"):
        PoolConfig(kv_dtype="int3")


def test_rounded_blocks_never_meet_exact_ones_in_memory_or_on_disk(tiny_model, tiny_tok, tmp_path):
    exact = Engine(tiny_model, tiny_tok, disk_cache_dir=tmp_path)
    half = Engine(tiny_model, tiny_tok, pool_config=PoolConfig(kv_dtype="fp16"), disk_cache_dir=tmp_path)
    assert exact.extra_key() != half.extra_key()
    prompt = prompt_of(40)
    for engine in (exact, half):
        engine.generate(prompt, max_new_tokens=0).result()
        engine.close()  # spill every full block
    restarted = Engine(tiny_model, tiny_tok, disk_cache_dir=tmp_path)
    generation = restarted.generate([*prompt, 1], max_new_tokens=1).result()
    assert generation.stats.disk_tokens == 32 and restarted.disk_stats()["disk_corrupt"] == 0


def test_the_cli_engine_takes_kv_dtype():
    assert build_engine("tiny", kv_dtype="fp16").pool.kv_dtype == torch.float16
