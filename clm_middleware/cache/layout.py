"""The shape of one model's KV cache, and the pool's capacity settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clm_middleware.errors import ConfigError, UnsupportedModelError

BLOCK_SIZE = 16  # vLLM's default: hit granularity vs. the length of block tables
DEFAULT_MAX_KV_BYTES = 1 << 30  # 1 GiB of K+V; storage is reserved lazily, pages fill as used
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-token KV geometry: every layer stores ``num_kv_heads × head_dim`` keys and values."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_as(self.dtype)

    def bytes_per_token_as(self, dtype: torch.dtype) -> int:
        """K+V bytes of one token stored as ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> KVLayout:
        """Read the layout from a transformers model; refuse what the pool cannot hold exactly."""
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
            raise UnsupportedModelError(
                f"{type(model).__name__} uses sliding-window attention, which the block pool cannot reuse exactly",
                hint="use a model with full attention on every layer",
            )
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types and any(kind != "full_attention" for kind in layer_types):
            raise UnsupportedModelError(
                f"{type(model).__name__} mixes attention kinds {sorted(set(layer_types))}",
                hint="use a model with full attention on every layer",
            )
        num_heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        parameter = next(model.parameters())
        return cls(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            dtype=parameter.dtype,
            device=parameter.device,
        )


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Capacity and granularity of a :class:`BlockPool`.

    Give ``max_blocks`` or ``max_kv_bytes`` (or both: the smaller wins). With neither,
    the pool holds :data:`DEFAULT_MAX_KV_BYTES` of K and V.

    ``kv_dtype`` is the pool's storage dtype (``float32``, ``bfloat16``, ``float16``, or
    ``fp32`` / ``bf16`` / ``fp16``); ``None`` stores at the model's dtype, the exact
    default. A narrower dtype halves the pool's bytes per block (so the same
    ``max_kv_bytes`` holds twice the blocks), but a hit then serves K/V rounded to it:
    reuse is no longer exact (measured in docs/benchmarks.md), and it is opt-in. The
    working arena the model attends over stays at the model's dtype.
    """

    block_size: int = BLOCK_SIZE
    max_blocks: int | None = None
    max_kv_bytes: int | None = None
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is not None and KV_DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype) not in KV_DTYPES:
            raise ConfigError(
                "kv_dtype", f"must be one of {', '.join([*KV_DTYPES, *KV_DTYPE_ALIASES])}, got {self.kv_dtype!r}"
            )
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be ≥ 1, got {self.block_size}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ConfigError("max_blocks", f"must be ≥ 1, got {self.max_blocks}")
        if self.max_kv_bytes is not None and self.max_kv_bytes < 1:
            raise ConfigError("max_kv_bytes", f"must be ≥ 1, got {self.max_kv_bytes}")

    def storage_dtype(self, layout: KVLayout) -> torch.dtype:
        """The dtype blocks are stored in: ``kv_dtype``, or the model's."""
        if self.kv_dtype is None:
            return layout.dtype
        return KV_DTYPES[KV_DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype)]

    def num_blocks(self, layout: KVLayout) -> int:
        block_bytes = layout.bytes_per_token_as(self.storage_dtype(layout)) * self.block_size
        limits = []
        if self.max_blocks is not None:
            limits.append(self.max_blocks)
        if self.max_kv_bytes is not None:
            limits.append(self.max_kv_bytes // block_bytes)
        if not limits:
            limits.append(DEFAULT_MAX_KV_BYTES // block_bytes)
        count = min(limits)
        if count < 1:
            raise ConfigError(
                "max_kv_bytes",
                f"{self.max_kv_bytes} bytes hold no block of {block_bytes} bytes",
            )
        return count
