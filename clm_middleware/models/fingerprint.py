"""Model fingerprints: the part of a KV block key that names the weights.

Two models share KV blocks only if they would compute the same keys and values:
same architecture config, same weights, same dtype and device kind. The fingerprint
hashes all of those. Hashing every parameter byte costs ~0.1 s for a 135M model, so
the result is remembered on the model object; a loader that knows the source file's
hash sets it directly instead.
"""

from __future__ import annotations

import torch
import xxhash

_ATTR = "_clm_fingerprint"


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hex digest identifying (config, weights, dtype, device type) of ``model``."""
    cached = getattr(model, _ATTR, None)
    if cached is not None:
        return cached
    digest = xxhash.xxh3_128()
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(_tensor_bytes(tensor))
    digest.update(_placement(model).encode())
    fingerprint = digest.hexdigest()
    set_fingerprint(model, fingerprint)
    return fingerprint


def set_fingerprint(model: torch.nn.Module, fingerprint: str) -> None:
    """Record a fingerprint known from the source (file hash + dtype + device)."""
    object.__setattr__(model, _ATTR, fingerprint)


def source_fingerprint(source_digest: str, model: torch.nn.Module) -> str:
    """Fingerprint from a source file's digest, the config and where the model runs."""
    digest = xxhash.xxh3_128(source_digest.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update(_placement(model).encode())
    return digest.hexdigest()


def _placement(model: torch.nn.Module) -> str:
    parameter = next(model.parameters())
    return f"{parameter.dtype}|{parameter.device.type}"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
