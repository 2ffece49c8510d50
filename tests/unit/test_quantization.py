"""quantization="int4": 4-bit layers and an 8-bit head, approximate, never mixed with exact blocks."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.cli.setup import build_engine, engine_description
from clm_middleware.engine import Engine
from clm_middleware.errors import ConfigError
from clm_middleware.models import quantization
from clm_middleware.models.quantization import (
    DENSE_FROM_ROWS,
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    model_quantization,
    parameter_count,
    quantize_model,
)


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 13 * i) % 250 for i in range(length)]


@pytest.fixture
def quantized(tiny_model):
    model = copy.deepcopy(tiny_model)
    report = quantize_model(model, "int4")
    return model, report


def q4_1_linear(out_features: int, in_features: int, bias: bool = False) -> torch.nn.Linear:
    """A linear layer whose weights are GGUF Q4_1 blocks de-quantized: code * d + m, d and m in fp16."""
    generator = torch.Generator().manual_seed(0)
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, groups, GROUP_SIZE), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 spans its block: the minimum is code 0, the maximum 15
    scale = (torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 1e-3).half().float()
    low = (-torch.rand(out_features, groups, 1, generator=generator) * 0.08).half().float()
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data = (codes * scale + low).reshape(out_features, in_features)
    return linear


@pytest.mark.parametrize("bias", [False, True])  # Qwen-style q/k/v carry a bias
def test_a_q4_1_layer_gets_its_own_codes_back_and_computes_within_bf16_of_fp32(bias):
    linear = q4_1_linear(64, 96, bias)
    layer = Int4Linear(linear)
    assert layer.max_weight_error < 1e-7  # the file's codes, scales and minimums, recovered
    hidden = torch.randn(3, 5, 96)
    expected = linear(hidden)
    got = layer(hidden)
    assert got.shape == expected.shape and got.dtype == hidden.dtype
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 arithmetic, bf16 scales


def test_an_8_bit_head_computes_within_a_few_percent_of_fp32():
    linear = torch.nn.Linear(64, 258, bias=True)
    layer = Int8Linear(linear)
    hidden = torch.randn(4, 64)
    expected = linear(hidden)
    assert (layer(hidden) - expected).abs().max() <= 3e-2 * expected.abs().max()


def test_every_layer_the_kernels_take_is_replaced_and_the_parameter_count_stays(tiny_model, quantized):
    model, report = quantized
    layers = tiny_model.config.num_hidden_layers
    assert report.int4_layers == 7 * layers  # q, k, v, o, gate, up, down
    assert report.int8_layers == 1 and report.kept_layers == 0
    assert isinstance(model.lm_head, Int8Linear)
    assert report.bytes_after < report.bytes_before / 3
    assert parameter_count(model) == parameter_count(tiny_model) == sum(p.numel() for p in tiny_model.parameters())
    assert model_quantization(model) == "int4" and model_quantization(tiny_model) is None


def test_a_layer_of_a_width_the_kernels_cannot_take_stays_as_loaded():
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Linear(32, 24), torch.nn.Linear(32, 32))
    model[2] = torch.nn.Linear(32, 32)
    report = quantize_model(model, "int4")
    assert (report.int4_layers, report.kept_layers) == (1, 2)  # in 20 (not a multiple of 32), out 24 (of 16)
    assert isinstance(model[0], torch.nn.Linear) and isinstance(model[1], torch.nn.Linear)
    assert isinstance(model[2], Int4Linear)


def test_quantized_logits_are_close_to_exact_and_a_pool_hit_equals_a_recompute_with_the_same_weights(
    tiny_model, tiny_tok, quantized
):
    model, _ = quantized
    prompt, tail = prompt_of(70), prompt_of(9, offset=3)
    exact = Engine(tiny_model, tiny_tok).generate(prompt + tail, max_new_tokens=1, return_logits=True).result()
    engine = Engine(model, tiny_tok, pool_config=None)
    fresh = engine.generate(prompt + tail, max_new_tokens=1, use_pool=False, return_logits=True).result()
    spread = exact.logits[0].abs().max()
    assert (fresh.logits[0] - exact.logits[0]).abs().max() <= 0.1 * spread
    engine.generate(prompt, max_new_tokens=0).result()
    engine.runner.arenas = type(engine.runner.arenas)(engine.layout, engine.block_size)  # no arena holds it: gather
    hit = engine.generate(prompt + tail, max_new_tokens=1, return_logits=True).result()
    assert hit.stats.cached_tokens == 70
    # the kernels compute each row on its own: reuse stays token-exact against the same weights
    assert torch.allclose(hit.logits[0], fresh.logits[0], atol=1e-4)


def test_int4_bf16_computes_prefill_chunks_densely_and_decode_from_the_codes():
    layer = Int4Linear(q4_1_linear(64, 96), dense_prefill=True)
    dense = layer.dense_weight
    chunk, step = torch.randn(DENSE_FROM_ROWS, 96), torch.randn(1, 96)
    assert torch.equal(layer(chunk), torch.nn.functional.linear(chunk.bfloat16(), dense).float())
    plain = Int4Linear(q4_1_linear(64, 96))
    assert plain.dense_weight is None
    assert torch.equal(layer(step), plain(step))  # one row: the 4-bit kernel, as int4


def test_int4_bf16_hits_are_close_to_a_recompute_and_prefill_is_dense(tiny_model, tiny_tok, monkeypatch):
    monkeypatch.setattr(quantization, "native_bf16_matmul", lambda: True)  # a CPU with AVX-512 or AMX
    model = copy.deepcopy(tiny_model)
    report = quantize_model(model, "int4-bf16")
    assert report.int4_layers == 7 * tiny_model.config.num_hidden_layers and model_quantization(model) == "int4-bf16"
    assert report.dense_prefill and model.lm_head.dense_weight is not None
    engine = Engine(model, tiny_tok)
    prompt, tail = prompt_of(70), prompt_of(9, offset=3)
    fresh = engine.generate(prompt + tail, max_new_tokens=1, use_pool=False, return_logits=True).result()
    engine.generate(prompt, max_new_tokens=0).result()
    hit = engine.generate(prompt + tail, max_new_tokens=1, return_logits=True).result()
    assert hit.stats.cached_tokens == 70
    # the tail's 9 rows take the 4-bit kernel here, the dense product in the fresh run
    spread = float(fresh.logits[0].abs().max())
    assert torch.allclose(hit.logits[0], fresh.logits[0], atol=0.05 * spread)


@pytest.mark.parametrize("fmt", ["int4", "int4-bf16"])
def test_on_a_cpu_that_emulates_bf16_quantizing_warns_and_int4_bf16_keeps_no_dense_copy(tiny_model, fmt, monkeypatch):
    monkeypatch.setattr(quantization, "native_bf16_matmul", lambda: False)  # an AVX2-only CPU
    model = copy.deepcopy(tiny_model)
    with pytest.warns(RuntimeWarning, match="no native bf16 matrix multiply") as caught:
        report = quantize_model(model, fmt)
    message = str(caught[0].message)
    assert f"quantization={fmt!r}" in message and "prefill is 1.5-2x slower" in message
    assert ("keeps no dense bf16 copy" in message) == (fmt == "int4-bf16")
    assert not report.dense_prefill and model_quantization(model) == fmt
    assert all(layer.dense_weight is None for layer in model.modules() if isinstance(layer, (Int4Linear, Int8Linear)))


def test_the_cli_prints_the_emulated_bf16_warning_as_one_warning_line(tmp_path, monkeypatch):
    monkeypatch.setattr(quantization, "native_bf16_matmul", lambda: False)
    transcript = tmp_path / "chat.jsonl"
    lines = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}]
    transcript.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = ["replay", str(transcript), "--model", "tiny", "--max-new-tokens", "2", "--quantization", "int4-bf16"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "no native bf16" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: quantization='int4-bf16': this CPU")
    assert "RuntimeWarning" not in result.stderr and ".py:" not in result.stderr


def test_the_bf16_probe_answers_a_bool_and_the_same_every_time():
    assert quantization.native_bf16_matmul() in (True, False)
    assert quantization.native_bf16_matmul() is quantization.native_bf16_matmul()


def test_quantized_and_exact_weights_never_share_blocks_in_memory_or_on_disk(tiny_model, tiny_tok, quantized, tmp_path):
    model, _ = quantized
    exact = Engine(tiny_model, tiny_tok, disk_cache_dir=tmp_path)
    approximate = Engine(model, tiny_tok, pool=exact.pool, disk_cache_dir=tmp_path)
    assert approximate.fingerprint != exact.fingerprint
    prompt = prompt_of(80)
    exact.generate(prompt, max_new_tokens=0).result()
    exact.close()  # spill to disk as well
    assert approximate.generate(prompt, max_new_tokens=1).result().stats.cached_tokens == 0


def test_an_unknown_format_a_second_quantization_and_another_device_name_the_field(tiny_model, quantized):
    model, _ = quantized
    with pytest.raises(ConfigError, match=r"quantization.*unknown format 'int3'"):
        quantize_model(copy.deepcopy(tiny_model), "int3")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_model(model, "int4")
    meta = copy.deepcopy(tiny_model).to("meta")
    with pytest.raises(ConfigError, match="CPU only"):
        quantize_model(meta, "int4")


def test_the_cli_engine_takes_quantization_and_reports_it():
    engine = build_engine("tiny", quantization="int4")
    assert engine_description(engine)["quantization"] == "int4"
    assert "quantization" not in engine_description(build_engine("tiny"))
    assert len(engine.generate(prompt_of(20), max_new_tokens=4).result().token_ids) == 4
    with pytest.raises(ConfigError, match="quantization"):
        build_engine("tiny", quantization="int4", engine_url="http://127.0.0.1:9")
