"""A decode step compiled ahead of time (opt-in, CPU): ``compile_decode=True``.

One decode step through transformers runs ~1,000 small operators, each dispatched from
Python between the model's modules: on SmolLM2-135M with 4-bit weights that is about
half of an 18 ms step, the weight products the other half. This module exports one
decode step of a Llama-family model with ``torch.export`` and compiles it with
AOTInductor into a shared library: the small operators fused into generated C++
kernels, the whole step called from C++, with no Python and no guard checks between
operators. The library holds code only: the weights stay the model's own tensors,
handed to it at load (AOTInductor's user-managed constants), so nothing is held twice.

The step reads the working arena (cache/arena.py) as it is, ``[layers, kv_heads,
capacity, head_dim]``, or with ``paged_kv`` the pool's storage and the request's block
table, attends the new token over the first ``n`` positions plus its own K/V, and
returns the logits and the token's K/V, which :meth:`CompiledDecoder.step` writes at
position ``n`` (the compiled code mutates nothing: an input written inside the library
would be copied whole on every step).

Compiling takes ~45 s for SmolLM2 on this machine's CPU; the library is cached under
``<cache dir>/compiled/`` (owner-only), keyed by the model's structure (config, tensor
names, shapes and dtypes, not the weights' values), the torch version and this
module's :data:`STEP_VERSION`, so later engines load it in about a second.

Invariants:

- The step computes what the model's forward computes for one token after ``n``
  cached positions, with the same weights: fp32 logits within float rounding of the
  uncompiled forward (the fused kernels sum in another order); with bf16-compute
  quantized weights (``quantization="int4"``), within bf16 rounding. Prefill never uses
  it: teacher-forced figures (``reply_nll``) do not move.
- A library is used only after a self-check against the uncompiled forward on a short
  prompt; a cached one that fails to load or to check is deleted and compiled again,
  never used. A fresh one that fails raises :class:`CompileError`.
- A step reads the kind of cache it was compiled for: a working arena (not during a
  scattered write), or with ``paged_kv`` the pool's blocks in place
  (:class:`PagedDecodeStep`: the past widened from the pool's ``kv_dtype`` inside the
  attention's sums, no gathered copy; the token's own K/V at the model's dtype, as the
  paged forward attends). Anything else decodes through the model's forward (e.g. a
  paged engine's request outside the pool, ``use_pool=False``, which runs in an arena).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.cache.paged import PagedCache
from clm_middleware.errors import ClmError, ConfigError
from clm_middleware.private_dirs import make_private_dirs

log = logging.getLogger(__name__)

STEP_VERSION = 1  # bump when DecodeStep's computation changes: cached libraries are rebuilt
# decoder layers as Llama's: pre-norm attention with rotary embeddings and an MLP; q/k/v
# biases (Qwen2) and per-head q/k norms (Qwen3) are the layers' own modules
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_CHECK_PROMPT = 8  # positions before the self-check's decode step
_TORCH_LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class CompileError(ClmError, RuntimeError):
    """The decode step could not be compiled, or the compiled step disagrees with the model."""


class DecodeStep(torch.nn.Module):
    """One decode step of a Llama-family causal LM (:data:`SUPPORTED_MODEL_TYPES`), as a
    function of tensors only, over a working arena.

    ``forward(token [1], position [1], keys, values, context)`` with ``keys`` and
    ``values`` ``[layers, kv_heads, capacity, head_dim]`` holding positions
    ``0..n`` where ``n = context.shape[0]`` (``context`` carries no data: its length is
    the export's dynamic size) and ``position == n``. Returns the next-token logits
    ``[vocab]`` and the token's keys and values ``[layers, kv_heads, 1, head_dim]``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        token: torch.Tensor,
        position: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        context: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = context.shape[0]

        def past(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            return keys[index, :, :n], values[index, :, :n]

        return self._step(token, position, past, fused=False)

    def _step(self, token, position, past, *, fused: bool):
        """The layers, with ``past(layer) -> (keys, values)`` ``[kv_heads, n, head_dim]``
        of the positions before ``position``; ``fused``: attend with elementwise products
        and sums (the compiler folds the past's indexing and widening into them, so no
        copy of it is made) instead of batched products."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        base = self.model.model
        hidden = base.embed_tokens(token.view(1, 1))
        cos, sin = base.rotary_emb(hidden, position.view(1, 1))
        new_keys, new_values = [], []
        for index, layer in enumerate(base.layers):
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            shape = (1, 1, -1, attention.head_dim)
            query = attention.q_proj(normed).view(shape)
            key = attention.k_proj(normed).view(shape)
            if getattr(attention, "q_norm", None) is not None:  # Qwen3: RMS norm per head
                query, key = attention.q_norm(query), attention.k_norm(key)
            query, key = query.transpose(1, 2), key.transpose(1, 2)
            value = attention.v_proj(normed).view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            new_keys.append(key[0])
            new_values.append(value[0])
            past_keys, past_values = past(index)
            # grouped-query attention without copies: kv head j serves query heads
            # j*groups .. (j+1)*groups - 1 (transformers' repeat_kv order), one row each
            grouped = query.reshape(past_keys.shape[0], -1, query.shape[-1])  # [kv_heads, groups, head_dim]
            if fused:
                past_scores = (grouped[:, :, None, :] * past_keys[:, None].to(grouped.dtype)).sum(-1)
            else:
                past_scores = torch.bmm(grouped, past_keys.transpose(1, 2))
            scores = torch.cat([past_scores, torch.bmm(grouped, key[0].transpose(1, 2))], dim=-1)
            weights = torch.softmax(scores.float() * attention.scaling, dim=-1).to(grouped.dtype)
            if fused:
                mixed = (weights[..., :-1, None] * past_values[:, None].to(grouped.dtype)).sum(-2)
            else:
                mixed = torch.bmm(weights[..., :-1], past_values)
            mixed = mixed + weights[..., -1:] * value[0]
            hidden = hidden + attention.o_proj(mixed.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(base.norm(hidden))
        return logits[0, -1], torch.stack(new_keys), torch.stack(new_values)


class PagedDecodeStep(DecodeStep):
    """:class:`DecodeStep` over the pool's blocks in place (``paged_kv``):
    ``forward(token, position, pool_keys, pool_values, table, context)`` with the pool's
    storage ``[layers, kv_heads, blocks, block_size, head_dim]`` at its ``kv_dtype`` and
    ``table`` the block ids serving positions ``0..`` in order. The past is read from the
    blocks, widened to the model's dtype inside the attention's sums: no gathered copy."""

    def forward(  # type: ignore[override]
        self,
        token: torch.Tensor,
        position: torch.Tensor,
        pool_keys: torch.Tensor,
        pool_values: torch.Tensor,
        table: torch.Tensor,
        context: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = context.shape[0]

        def past(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            keys = pool_keys[index][:, table].flatten(1, 2)[:, :n]
            return keys, pool_values[index][:, table].flatten(1, 2)[:, :n]

        return self._step(token, position, past, fused=True)


def check_supported(model: torch.nn.Module) -> None:
    """``ConfigError`` (field ``compile_decode``) unless :class:`DecodeStep` computes ``model``'s step."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            "compile_decode",
            f"compiles Llama-family models ({', '.join(SUPPORTED_MODEL_TYPES)}); this model is {model_type!r}",
            hint="leave compile_decode off for this model",
        )
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError("compile_decode", f"compiles for the CPU; the model is on {device}")
    for layer in model.model.layers:
        attention = layer.self_attn
        if any(getattr(attention, name, None) is None for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            raise ConfigError("compile_decode", f"{type(attention).__name__} is not a Llama attention layer")


@dataclass(frozen=True, slots=True)
class CompileReport:
    """How the library came to be: ``source`` ``compiled`` or ``disk``, its path, the
    seconds it took (export and compile, or load), and the self-check's largest logit difference."""

    source: str
    path: str
    seconds: float
    max_logit_error: float


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What a paged step is compiled for: the pool's storage dtype and block size."""

    kv_dtype: torch.dtype
    block_size: int

    @property
    def suffix(self) -> str:
        return f"-paged-{str(self.kv_dtype).removeprefix('torch.')}-{self.block_size}"


class CompiledDecoder:
    """The compiled decode step of one model, loaded and checked; thread-safe (the
    library runs one step at a time). With ``paged`` it reads the pool's blocks in place
    (:class:`PagedDecodeStep`, for ``paged_kv``), else a working arena."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache_dir: str | os.PathLike[str] | None = None,
        paged: PoolGeometry | None = None,
    ) -> None:
        check_supported(model)
        self.model = model
        self.paged = paged
        self.module = PagedDecodeStep(model) if paged is not None else DecodeStep(model)
        self.dtype = next(model.parameters()).dtype
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_root()
        suffix = paged.suffix if paged is not None else ""
        self.path = self.cache_dir / f"decode-{structure_key(model)}{suffix}.pt2"
        self._lock = threading.Lock()
        self.report = self._load_or_compile()

    def step(self, token: int, cache: ArenaCache | PagedCache) -> torch.Tensor:
        """Decode ``token`` after the ``n`` positions ``cache`` holds: write its K/V at
        position ``n``, declare ``n + 1`` filled, return the next-token logits ``[vocab]``."""
        n = cache.num_tokens
        token_ids, position, context = torch.tensor([token]), torch.tensor([n]), torch.empty(n, 0)
        if isinstance(cache, PagedCache):
            pool_keys, pool_values = cache.pool.storage()
            table = cache.table[: -(-n // cache.block_size)]
            with self._lock:
                logits, keys, values = self._runner(token_ids, position, pool_keys, pool_values, table, context)
            cache.write_position(n, keys[:, :, 0], values[:, :, 0])
        else:
            with self._lock:
                logits, keys, values = self._runner(token_ids, position, cache.flat_keys, cache.flat_values, context)
            cache.flat_keys[:, :, n : n + 1].copy_(keys)
            cache.flat_values[:, :, n : n + 1].copy_(values)
        cache.reset_to(n + 1)
        return logits

    def serves(self, cache: object) -> bool:
        """Whether :meth:`step` can decode the next token into ``cache``: the kind it was
        compiled for (a working arena outside a scattered write, or a paged cache over a
        pool of its geometry), with a position left."""
        if self.paged is None:
            kind = isinstance(cache, ArenaCache) and cache.scatter is None and cache.flat_keys.dtype == self.dtype
        else:
            kind = (
                isinstance(cache, PagedCache)
                and cache.pool.kv_dtype == self.paged.kv_dtype
                and cache.block_size == self.paged.block_size
            )
        return kind and 0 < cache.num_tokens < cache.capacity_tokens and len(set(cache.layer_lengths)) == 1

    # -------------------------------------------------------------- internal

    def _load_or_compile(self) -> CompileReport:
        started = time.perf_counter()
        if self.path.exists():
            try:
                self._runner = self._load(self.path)
                error = self._self_check()
                return CompileReport("disk", str(self.path), time.perf_counter() - started, error)
            except Exception as problem:  # a damaged or stale library is never used
                log.warning("compiled decode step at %s is unusable (%s); compiling again", self.path, problem)
                self.path.unlink(missing_ok=True)
        started = time.perf_counter()
        log.info("compiling the decode step into %s (once per model structure and torch version)", self.path)
        self._compile(self.path)
        try:
            self._runner = self._load(self.path)
            error = self._self_check()
        except Exception as problem:
            self.path.unlink(missing_ok=True)
            raise CompileError(f"the compiled decode step is unusable: {problem}") from problem
        return CompileReport("compiled", str(self.path), time.perf_counter() - started, error)

    def _compile(self, path: Path) -> None:
        from torch.export import Dim

        example = self._example(self._check_length)
        capacity = Dim("capacity", min=2, max=1 << 20)
        context = {0: Dim("context", min=1, max=(1 << 20) - 1)}
        if self.paged is None:
            dynamic: tuple = ({}, {}, {2: capacity}, {2: capacity}, context)
        else:
            dynamic = ({}, {}, {2: capacity}, {2: capacity}, {0: Dim("table", min=1, max=1 << 20)}, context)
        try:
            make_private_dirs(path.parent)
            descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".pt2", dir=path.parent)
        except OSError as problem:
            raise CompileError(
                f"cannot write the compiled decode step under {path.parent}: {problem}",
                hint="set CLM_CACHE_DIR (or compile_cache_dir) to a writable directory",
            ) from problem
        os.close(descriptor)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                # torch's own export copies its tree specs through a class it has deprecated:
                # a FutureWarning printed to the user on every first compile, about torch's code
                warnings.filterwarnings("ignore", message=_TORCH_LEAFSPEC_WARNING, category=FutureWarning)
                exported = torch.export.export(self.module, example, dynamic_shapes=dynamic, strict=False)
                torch._inductor.aoti_compile_and_package(
                    exported,
                    package_path=temporary,
                    inductor_configs={"aot_inductor.package_constants_in_so": False},
                )
            os.chmod(temporary, 0o600)
            os.replace(temporary, path)
        except Exception as problem:
            raise CompileError(f"compiling the decode step failed: {problem}") from problem
        finally:
            Path(temporary).unlink(missing_ok=True)

    def _load(self, path: Path):
        runner = torch._inductor.aoti_load_package(str(path))
        tensors = dict(self.module.named_parameters(remove_duplicate=False))
        tensors.update(self.module.named_buffers(remove_duplicate=False))
        constants = {}
        for name in runner.get_constant_fqns():
            if name in tensors:
                constants[name] = tensors[name]
            elif name.startswith("constant"):
                # a constant inductor made while lowering: the 4-bit kernel's group size
                # (aten._weight_int4pack_mm_for_cpu's int argument as a tensor); the
                # self-check catches any other
                from clm_middleware.models.quantization import GROUP_SIZE

                constants[name] = torch.tensor(GROUP_SIZE, dtype=torch.int64)
            else:
                raise CompileError(f"the compiled step wants {name!r}, which the model does not have")
        runner.load_constants(constants, check_full_update=True, user_managed=True)
        return runner

    @property
    def _check_length(self) -> int:
        """Positions before the self-check's step: two blocks' worth and more when paged."""
        return _CHECK_PROMPT if self.paged is None else self.paged.block_size + _CHECK_PROMPT

    def _example(self, n: int) -> tuple[torch.Tensor, ...]:
        """Inputs for a step after ``n`` positions, the K/V zero: an arena of ``2 n``
        positions, or a pool of ``2 b + 2`` blocks whose table lists ``b`` of them out of order."""
        layers = self.model.model.layers
        heads, head_dim = self.model.config.num_key_value_heads, layers[0].self_attn.head_dim
        if self.paged is None:
            keys = torch.zeros(len(layers), heads, 2 * n, head_dim, dtype=self.dtype)
            return torch.tensor([1]), torch.tensor([n]), keys, torch.zeros_like(keys), torch.empty(n, 0)
        size = self.paged.block_size
        blocks = -(-n // size)
        keys = torch.zeros(len(layers), heads, 2 * blocks + 2, size, head_dim, dtype=self.paged.kv_dtype)
        table = torch.arange(2 * blocks, 0, -2)  # every other block, last first
        return torch.tensor([1]), torch.tensor([n]), keys, torch.zeros_like(keys), table, torch.empty(n, 0)

    def _self_check(self) -> float:
        """The compiled step against the model's forward after a short prompt; the
        largest logit difference, or ``CompileError`` past the tolerance."""
        from transformers import DynamicCache

        from clm_middleware.models.quantization import model_quantization

        n = self._check_length
        vocab = int(self.model.config.vocab_size)
        ids = (torch.arange(n + 1) * 7919 + 11) % vocab
        example = list(self._example(n))
        example[0] = ids[n:]
        keys, values = example[2], example[3]
        if self.paged is not None:  # positions p -> block table[p // size], row p % size
            positions = torch.arange(n)
            blocks, rows = example[4][positions // self.paged.block_size], positions % self.paged.block_size
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            self.model(input_ids=ids[None, :n], cache=cache, use_cache=True)
            for index, layer in enumerate(cache.layers):
                if self.paged is None:
                    keys[index, :, :n] = layer.keys[0]
                    values[index, :, :n] = layer.values[0]
                else:
                    keys[index][:, blocks, rows] = layer.keys[0].to(keys.dtype)
                    values[index][:, blocks, rows] = layer.values[0].to(values.dtype)
            expected = self.model(input_ids=ids[None, n:], cache=cache, use_cache=True).logits[0, -1]
            got, new_keys, _ = self._runner(*example)
        expected_keys = torch.stack([layer.keys[0, :, -1:] for layer in cache.layers])
        error = float((got.float() - expected.float()).abs().max())
        key_error = float((new_keys.float() - expected_keys.float()).abs().max())
        stored_exactly = self.paged is None or self.paged.kv_dtype == self.dtype
        exact_weights = model_quantization(self.model) is None and self.dtype == torch.float32 and stored_exactly
        relative = 1e-3 if exact_weights else 5e-2
        tolerance = relative * max(1.0, float(expected.abs().max()))
        key_tolerance = relative * max(1.0, float(expected_keys.abs().max()))
        if not (error <= tolerance and key_error <= key_tolerance) or not torch.isfinite(got).all():
            raise CompileError(
                f"the compiled step differs from the model's forward: logits by {error:.3g}, "
                f"keys by {key_error:.3g} (tolerances {tolerance:.3g}, {key_tolerance:.3g})"
            )
        return error


def structure_key(model: torch.nn.Module) -> str:
    """What a compiled step depends on: the config, every tensor's name, shape and
    dtype (not its values), the weight format, torch's version and :data:`STEP_VERSION`."""
    from clm_middleware.models.quantization import model_quantization

    digest = xxhash.xxh3_128()
    digest.update(model.config.to_json_string(use_diff=False).encode())
    shapes = {name: [list(tensor.shape), str(tensor.dtype)] for name, tensor in model.state_dict().items()}
    digest.update(json.dumps(shapes, sort_keys=True).encode())
    digest.update(f"{model_quantization(model)}|{torch.__version__}|{STEP_VERSION}".encode())
    return digest.hexdigest()


def _default_root() -> Path:
    from clm_middleware.models.loading import default_cache_dir

    return default_cache_dir() / "compiled"
