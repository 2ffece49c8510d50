"""The shape of one model's KV cache, and the pool's capacity settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clm_middleware.errors import ConfigError, UnsupportedModelError

BLOCK_SIZE = 16  # vLLM's default: hit granularity vs. the length of block tables
DEFAULT_MAX_KV_BYTES = 1 << 30  # 1 GiB of K+V; storage is reserved lazily, pages fill as used


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
        itemsize = torch.empty((), dtype=self.dtype).element_size()
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
    """

    block_size: int = BLOCK_SIZE
    max_blocks: int | None = None
    max_kv_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be ≥ 1, got {self.block_size}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ConfigError("max_blocks", f"must be ≥ 1, got {self.max_blocks}")
        if self.max_kv_bytes is not None and self.max_kv_bytes < 1:
            raise ConfigError("max_kv_bytes", f"must be ≥ 1, got {self.max_kv_bytes}")

    def num_blocks(self, layout: KVLayout) -> int:
        block_bytes = layout.bytes_per_token * self.block_size
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
