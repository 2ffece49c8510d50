"""compile_decode: a decode step compiled ahead of time computes what the model's forward does."""

import copy
import warnings

import pytest
import torch

from adapters.langchain import ChatCLM
from clm_middleware.cli.setup import engine_description, sibling_engine
from clm_middleware.engine import Engine
from clm_middleware.engine.compiled_decode import CompiledDecoder, check_supported, structure_key
from clm_middleware.errors import ConfigError
from clm_middleware.models.quantization import quantize_model


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 13 * i) % 250 for i in range(length)]


@pytest.fixture(scope="module")
def compile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def compiled_engine(tiny_model, tiny_tok, compile_dir):
    """Compiled once for the module (~10 s); later engines load it from ``compile_dir``."""
    return Engine(tiny_model, tiny_tok, compile_decode=True, compile_cache_dir=compile_dir)


@pytest.fixture(scope="module")
def int4_model(tiny_model):
    model = copy.deepcopy(tiny_model)
    quantize_model(model, "int4")
    return model


@pytest.fixture(scope="module")
def int4_decoder(int4_model, compile_dir):
    return CompiledDecoder(int4_model, cache_dir=compile_dir)  # the 4-bit kernel's own constants


def test_compiled_decode_gives_the_forwards_tokens_and_logits(compiled_engine, tiny_model, tiny_tok):
    plain = Engine(tiny_model, tiny_tok)
    prompt = prompt_of(37)
    expected = plain.generate(prompt, max_new_tokens=24, temperature=0.9, seed=3, return_logits=True).result()
    got = compiled_engine.generate(prompt, max_new_tokens=24, temperature=0.9, seed=3, return_logits=True).result()
    assert got.token_ids == expected.token_ids
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, expected.logits, strict=True)) <= 1e-4
    assert compiled_engine.decoder.report.max_logit_error <= 1e-4


def test_decoded_tokens_kv_serve_a_later_prompt_like_a_recompute(compiled_engine, tiny_model, tiny_tok):
    """The K/V the compiled step writes are stored in the pool; a prompt extending the
    reply reuses them and gets the logits a cold engine computes from scratch."""
    prompt = prompt_of(29, offset=5)
    first = compiled_engine.generate(prompt, max_new_tokens=20).result()
    extended = prompt + first.token_ids + prompt_of(6, offset=90)
    warm = compiled_engine.generate(extended, max_new_tokens=1, return_logits=True).result()
    assert warm.stats.cached_tokens >= len(prompt) + len(first.token_ids) - 1 - compiled_engine.block_size
    cold = Engine(tiny_model, tiny_tok).generate(extended, max_new_tokens=1, return_logits=True).result()
    assert float((warm.logits[0] - cold.logits[0]).abs().max()) <= 1e-4


def test_a_second_engine_loads_the_library_from_disk(compiled_engine):
    sibling = sibling_engine(compiled_engine)
    assert sibling.decoder is not None
    assert sibling.decoder.report.source == "disk"
    assert sibling.decoder.path == compiled_engine.decoder.path
    assert oct(sibling.decoder.path.stat().st_mode & 0o777) == oct(0o600)
    assert engine_description(sibling)["compile_decode"] is True


def test_a_corrupt_library_is_compiled_again_never_used(tiny_model, tmp_path):
    (tmp_path / f"decode-{structure_key(tiny_model)}.pt2").write_bytes(b"not a package" * 100)
    again = CompiledDecoder(tiny_model, cache_dir=tmp_path)
    assert again.report.source == "compiled"
    assert again.report.max_logit_error <= 1e-4


def test_compiling_prints_no_warning_about_torchs_own_code(tiny_model, tmp_path):
    """torch's export copies its tree specs through a class it deprecated: every first
    --compile-decode printed a FutureWarning the user can do nothing about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CompiledDecoder(tiny_model, cache_dir=tmp_path)
    assert not [w for w in caught if issubclass(w.category, FutureWarning) and "LeafSpec" in str(w.message)]


def test_a_library_of_another_structure_is_never_loaded(tiny_model, int4_model, int4_decoder, tmp_path):
    assert structure_key(int4_model) != structure_key(tiny_model)
    # a stale library under this key (another model's) fails its load or its check and is rebuilt
    plain_path = tmp_path / f"decode-{structure_key(tiny_model)}.pt2"
    plain_path.write_bytes(int4_decoder.path.read_bytes())
    rebuilt = CompiledDecoder(tiny_model, cache_dir=tmp_path)
    assert rebuilt.report.source == "compiled"


def test_int4_compiled_decode_stays_within_bf16_rounding(int4_model, int4_decoder, tiny_tok):
    engine = Engine(int4_model, tiny_tok, compile_decode=True, compile_cache_dir=int4_decoder.cache_dir)
    assert engine.decoder.report.source == "disk"
    plain = Engine(int4_model, tiny_tok)
    prompt = prompt_of(41, offset=2)
    got = engine.generate(prompt, max_new_tokens=2, return_logits=True).result()
    expected = plain.generate(prompt, max_new_tokens=2, return_logits=True).result()
    assert got.token_ids[0] == expected.token_ids[0]  # from the prefill: the same computation
    scale = float(expected.logits[1].abs().max())
    assert float((got.logits[1] - expected.logits[1]).abs().max()) <= 0.05 * max(1.0, scale)


@pytest.mark.parametrize("kv_dtype", [None, "fp16"])
def test_with_paged_kv_the_step_reads_the_pool_blocks_as_the_paged_forward_does(
    tiny_model, tiny_tok, compile_dir, kv_dtype
):
    """The past from the pool's blocks (rounded to kv_dtype), the token's own K/V exact:
    the paged forward's semantics, so the tokens and logits are the paged engine's."""
    from clm_middleware.cache.layout import PoolConfig

    def paged(**extra) -> Engine:
        config = PoolConfig(max_blocks=64, kv_dtype=kv_dtype)
        return Engine(tiny_model, tiny_tok, pool_config=config, paged_kv=True, **extra)

    compiled = paged(compile_decode=True, compile_cache_dir=compile_dir)
    assert compiled.decoder.paged is not None
    plain = paged()
    first = prompt_of(37, offset=3)  # two full blocks and a tail: the second call extends a cached chain
    for prompt in (first, first + prompt_of(11, offset=60)):
        got = compiled.generate(prompt, max_new_tokens=20, return_logits=True).result()
        expected = plain.generate(prompt, max_new_tokens=20, return_logits=True).result()
        assert got.token_ids == expected.token_ids
        assert max(float((a - b).abs().max()) for a, b in zip(got.logits, expected.logits, strict=True)) <= 1e-4
        assert got.stats.cached_tokens == expected.stats.cached_tokens
    compiled.pool.check_invariants()
    assert compiled.working_kv_bytes(100) == plain.working_kv_bytes(100)  # one tile of one layer, no more


def test_a_serving_engine_refuses_local_engine_settings():
    with pytest.raises(ConfigError, match=r"compile_decode: applies to the local engine"):
        ChatCLM(model="tiny", engine_url="http://127.0.0.1:9", compile_decode=True)


def test_a_model_that_is_not_llama_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
    with pytest.raises(ConfigError, match=r"compile_decode: .*'gpt2'"):
        check_supported(model)


def test_the_step_serves_only_a_working_arena(compiled_engine):
    from clm_middleware.cache.arena import ArenaCache

    arena = ArenaCache(compiled_engine.layout, capacity_blocks=2, block_size=16)
    assert not compiled_engine.decoder.serves(arena)  # empty: nothing to decode after
    arena.reset_to(5)
    assert compiled_engine.decoder.serves(arena)
    with arena.scattered(torch.tensor([5]), 6):
        assert not compiled_engine.decoder.serves(arena)
    arena.reset_to(32)
    assert not compiled_engine.decoder.serves(arena)  # full


@pytest.mark.parametrize("architecture", ["qwen2", "mistral", "qwen3"])
def test_other_llama_family_models_decode_as_their_forward(architecture, tiny_tok, tiny_family_model, tmp_path):
    """q/k/v biases (Qwen2), per-head q/k norms (Qwen3): the layers' own modules, in the step."""
    model = tiny_family_model(architecture)
    engine = Engine(model, tiny_tok, compile_decode=True, compile_cache_dir=tmp_path)
    prompt = prompt_of(23, offset=7)
    got = engine.generate(prompt, max_new_tokens=8, return_logits=True).result()
    expected = Engine(model, tiny_tok).generate(prompt, max_new_tokens=8, return_logits=True).result()
    assert got.token_ids == expected.token_ids
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, expected.logits, strict=True)) <= 1e-4


def test_an_unwritable_cache_dir_fails_with_a_clear_error(tiny_model, tmp_path):
    from clm_middleware.engine.compiled_decode import CompileError

    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would go")
    with pytest.raises(CompileError, match=r"cannot write the compiled decode step under .*CLM_CACHE_DIR"):
        CompiledDecoder(tiny_model, cache_dir=blocked / "compiled")
