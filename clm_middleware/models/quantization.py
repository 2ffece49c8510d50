"""Weight-only quantization for CPU decode (opt-in, approximate): ``quantization="int4"`` / ``"int4-bf16"``.

Decoding one token reads every weight once, so on a CPU decode speed is the bytes of
weights per token: SmolLM2-135M in fp32 reads 540 MB a token; llama.cpp reads its
Q4_1 file, about a sixth of that. ``int4`` stores each decoder linear layer as 4-bit
codes with a scale and a minimum per 32 input weights (asymmetric, GGUF's Q4_1 layout)
and runs it with PyTorch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``); the
LM head becomes 8-bit codes with one scale per output row (``aten._weight_int8pack_mm``).
Both kernels compute in bf16. Prefill chunks use the same kernels (faster than fp32
matmuls here too). ``int4-bf16`` also keeps the same weights dense in bf16 and uses
them for inputs of ``DENSE_FROM_ROWS`` rows or more (prefill chunks), where a dense bf16
product is 2-3x faster than the quantized kernels: faster prefill for ~210 MB more
(still less than the fp32 weights); decode reads the 4-bit codes as with ``int4``.

All of that holds on a CPU that multiplies bf16 natively (oneDNN's bf16 support:
AVX-512 or AMX). On one that does not (an AVX2-only CPU) bf16 products are emulated:
there, on an AVX2 EPYC, a 1,024-token prefill from scratch took 30.2 s with the dense
bf16 copy, 9.0-10.6 s with the 4-bit kernels and 5.1-6.0 s with fp32 weights, while
decode still gained (81-101 against 146-160 ms a token, uncompiled;
``docs/bench_cpu_formats.py``). So on such a CPU ``int4-bf16``
keeps no dense copy (it computes as ``int4``), and both formats warn once that
prefill will be slower than with the weights as loaded (:func:`native_bf16_matmul`).

Invariants:

- Only ``torch.nn.Linear`` modules whose shapes the kernels take are replaced (4-bit:
  input features a multiple of 32, output features of 16; the head: input features a
  multiple of 32): any other layer stays as loaded, and :class:`QuantizationReport`
  says how many of each.
- On a Q4_1 GGUF (the default model) the 4-bit codes, scales and minimums are the
  file's own: re-quantizing its de-quantized weights gives them back
  (``max_weight_error`` 0.0 on SmolLM2). What is approximate is the bf16 arithmetic,
  the scales held in bf16 and the head's per-row 8-bit codes (the file's head is Q8_0,
  one scale per 32 weights).
- With ``int4``, every row is computed alike whatever the chunk, so a pool hit equals a
  recompute with the same weights (≤ 1e-4). With ``int4-bf16`` a position's K/V depend on
  whether its chunk had ``DENSE_FROM_ROWS`` rows: a hit is close to a recompute, not
  equal (as with a bf16 pool, ``kv_dtype``).
- Whether ``int4-bf16`` keeps its dense copy depends on the CPU alone
  (:func:`native_bf16_matmul`), never on a timing: the same machine always computes
  the same K/V. ``QuantizationReport.dense_prefill`` says which.
- The model gets its own fingerprint (the exact one plus the format): K/V computed
  with quantized weights never serve an exact engine, in memory or on disk, nor the
  other way round.
- A quantized model keeps the parameter count it had (``parameter_count``), and holds
  no reference into the file it was loaded from.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import xxhash

from clm_middleware.errors import ConfigError
from clm_middleware.models.fingerprint import model_fingerprint, set_fingerprint

QUANTIZATIONS = ("int4", "int4-bf16")
GROUP_SIZE = 32  # input weights per scale and minimum, as GGUF's Q4_1 blocks
# int4-bf16: from this many rows (prefill chunks) a dense bf16 product is faster than the
# quantized kernels (2-3x at 27 rows on this CPU); below it (decode) reading fewer bytes wins
DENSE_FROM_ROWS = 16
_COMPUTE_DTYPE = torch.bfloat16  # the CPU kernels' fast path (their fp32 / fp16 paths are ~40x slower)
_ATTR_FORMAT = "_clm_quantization"
_ATTR_PARAMETERS = "_clm_parameter_count"


class _QuantizedLinear(torch.nn.Module):
    """What both formats share: the layer's shapes and bias, the optional dense bf16 copy
    (``dense_weight``, used from ``DENSE_FROM_ROWS`` rows), and a forward that computes
    in bf16 and returns the input's dtype. A subclass stores its codes and computes
    ``_quantized(flat)``."""

    def __init__(self, linear: torch.nn.Linear, restored: torch.Tensor, dense: torch.Tensor | None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.out_features, self.in_features = weight.shape
        self.max_weight_error = float((restored - weight).abs().max())
        self.register_buffer("dense_weight", None if dense is None else dense.to(_COMPUTE_DTYPE))
        self.bias = linear.bias

    def _quantized(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, self.in_features).to(_COMPUTE_DTYPE)
        if self.dense_weight is not None and flat.shape[0] >= DENSE_FROM_ROWS:
            out = torch.nn.functional.linear(flat, self.dense_weight)
        else:
            out = self._quantized(flat)
        out = out.to(hidden.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*hidden.shape[:-1], self.out_features)


class Int4Linear(_QuantizedLinear):
    """A linear layer of 4-bit codes, one bf16 scale and minimum per ``GROUP_SIZE`` inputs;
    with ``dense_prefill``, also the same weights in bf16 for inputs of ``DENSE_FROM_ROWS``
    rows or more."""

    def __init__(self, linear: torch.nn.Linear, dense_prefill: bool = False) -> None:
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low = groups.amin(-1, keepdim=True)
        scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low) / scale).round().clamp(0, 15)
        restored = (codes * scale + low).reshape(out_features, in_features)
        super().__init__(linear, restored, restored if dense_prefill else None)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).reshape(out_features, in_features), 1
        )
        self.register_buffer("packed_weight", packed)
        # the kernel's weight is (code - 8) * scale + zero, laid out [groups, out_features, 2]
        zero = low + 8 * scale
        scales_and_zeros = torch.stack([scale.reshape(out_features, -1).t(), zero.reshape(out_features, -1).t()], -1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(_COMPUTE_DTYPE))

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        out_features, in_features = linear.weight.shape
        return in_features % GROUP_SIZE == 0 and out_features % 16 == 0

    def _quantized(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, GROUP_SIZE, self.scales_and_zeros)


class Int8Linear(_QuantizedLinear):
    """A linear layer of symmetric 8-bit codes, one bf16 scale per output row; with
    ``dense_prefill``, also the loaded weights in bf16 for ``DENSE_FROM_ROWS`` rows or more."""

    def __init__(self, linear: torch.nn.Linear, dense_prefill: bool = False) -> None:
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (weight / scale[:, None]).round().clamp(-127, 127)
        super().__init__(linear, codes * scale[:, None], weight if dense_prefill else None)
        self.register_buffer("weight_codes", codes.to(torch.int8))
        self.register_buffer("scales", scale.to(_COMPUTE_DTYPE))

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        return linear.weight.shape[1] % GROUP_SIZE == 0  # the kernel crashes the process on some widths

    def _quantized(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight_codes, self.scales)


@dataclass(frozen=True, slots=True)
class QuantizationReport:
    """What :func:`quantize_model` replaced: ``int4_layers`` and ``int8_layers`` quantized,
    ``kept_layers`` left as loaded (shapes the kernels do not take), the largest
    difference between a quantized weight and the loaded one, and the bytes of the
    weights replaced before and after."""

    quantization: str
    int4_layers: int
    int8_layers: int
    kept_layers: int
    max_weight_error: float
    bytes_before: int
    bytes_after: int
    dense_prefill: bool = False  # int4-bf16 kept its dense bf16 copy for prefill chunks


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (oneDNN's bf16 support:
    AVX-512 or AMX), where the bf16 kernels and the dense bf16 copy are fast; on an
    AVX2-only CPU they are emulated and slower than fp32 (module docstring). True where
    PyTorch cannot tell (another build or architecture): the behaviour as documented."""
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if probe is None:
        return True
    try:
        return bool(probe())
    except RuntimeError:
        return True


def _warn_emulated_bf16(quantization: str) -> None:
    dense = (
        " int4-bf16 keeps no dense bf16 copy here (it would prefill slower still) and computes as int4."
        if quantization == "int4-bf16"
        else ""
    )
    warnings.warn(
        f"quantization={quantization!r}: this CPU has no native bf16 matrix multiply (no AVX-512 or AMX), "
        "so the 4-bit kernels emulate bf16: decode reads fewer bytes and stays faster than with fp32 "
        "weights, but prefill is 1.5-2x slower (1,024 tokens: 9.0-10.6 s against 5.1-6.0 s on an AVX2 EPYC)."
        f"{dense} Leave quantization out where prefill time matters more than decode speed and memory.",
        RuntimeWarning,
        stacklevel=3,
    )


def quantize_model(model: torch.nn.Module, quantization: str) -> QuantizationReport:
    """Replace ``model``'s linear layers in place (see the module docstring); the model
    must be on the CPU. Raises ``ConfigError`` for an unknown format, another device, or
    a model already quantized."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError("quantization", f"unknown format {quantization!r}; known: {', '.join(QUANTIZATIONS)}")
    if getattr(model, _ATTR_FORMAT, None) is not None:
        raise ConfigError("quantization", f"the model is already quantized ({getattr(model, _ATTR_FORMAT)})")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError("quantization", f"{quantization} runs on the CPU only; the model is on {device}")
    native = native_bf16_matmul()
    if not native:
        _warn_emulated_bf16(quantization)
    dense = quantization == "int4-bf16" and native
    exact_fingerprint = model_fingerprint(model)
    parameters = parameter_count(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    counts = {"int4": 0, "int8": 0, "kept": 0}
    error, before, after = 0.0, 0, 0
    # (parent, name) pairs, not the layers: each fp32 weight is freed once its layer is replaced
    places = [
        (parent, name)
        for parent in model.modules()
        if not isinstance(parent, torch.nn.Linear)
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]
    for parent, name in places:
        child = getattr(parent, name)
        kind, replacement = ("int8", Int8Linear) if child is head else ("int4", Int4Linear)
        if not replacement.fits(child):
            counts["kept"] += 1
            continue
        quantized = replacement(child, dense_prefill=dense)
        before += child.weight.numel() * child.weight.element_size()
        after += sum(buffer.numel() * buffer.element_size() for buffer in quantized.buffers())
        error = max(error, quantized.max_weight_error)
        setattr(parent, name, quantized)
        counts[kind] += 1
        del child
    with torch.no_grad():
        # what stays (embeddings, norms) leaves the loaded file's memory map, so the map and
        # the pages of the replaced fp32 weights can be released: 1.0 GB resident -> 0.6 GB
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()
    object.__setattr__(model, _ATTR_FORMAT, quantization)
    object.__setattr__(model, _ATTR_PARAMETERS, parameters)
    set_fingerprint(model, xxhash.xxh3_128(f"{exact_fingerprint}|weights={quantization}".encode()).hexdigest())
    return QuantizationReport(
        quantization, counts["int4"], counts["int8"], counts["kept"], error, before, after, dense_prefill=dense
    )


def model_quantization(model: torch.nn.Module) -> str | None:
    """The format :func:`quantize_model` gave ``model``; None for weights as loaded."""
    return getattr(model, _ATTR_FORMAT, None)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the model as loaded (a quantized layer's codes count as its weights)."""
    counted = getattr(model, _ATTR_PARAMETERS, None)
    return counted if counted is not None else sum(parameter.numel() for parameter in model.parameters())
