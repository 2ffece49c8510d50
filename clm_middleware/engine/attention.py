"""Grouped-query attention over the shared K/V heads, without ``repeat_kv`` copies.

A GQA model (SmolLM2: 9 query heads, 3 K/V heads) attends each K/V head from several
query heads. transformers' SDPA path copies every K/V head ``groups`` times
(``repeat_kv``) whenever a prefill chunk comes with a mask (every chunk after a cached
prefix), i.e. a copy of the whole context per layer per chunk; decode (one query) is
already copy-free there (``pack_gqa``). PyTorch's SDPA takes ``enable_gqa=True``
instead and broadcasts the heads inside the kernel: on CPU it runs the same fused
kernel (``_scaled_dot_product_flash_attention_for_cpu``, checked with the profiler) and
gives the same numbers (max abs diff 0.0 on SmolLM2 shapes), without the copies.

``use_gqa_attention`` registers this function under :data:`GQA_SDPA` through the
library's public ``AttentionInterface`` (and the SDPA mask builder with it) and points
a model whose attention is ``sdpa`` at it. Anything this path does not cover (one
query, a position bias, soft-capping, no K/V groups) goes to transformers' own
``sdpa_attention_forward``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GQA_SDPA = "clm_sdpa_gqa"


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    plain = (
        groups > 1
        and q_length > 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        # without a mask SDPA's causal flag is aligned top-left: right only for a square
        and (attention_mask is not None or kv_length == q_length)
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(causal and attention_mask is None),
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """Point ``model`` (attention ``sdpa``) at :func:`sdpa_gqa_forward`; True if it now uses it."""
    config = model.config
    if getattr(config, "_attn_implementation", None) == GQA_SDPA:
        return True
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False  # eager, flash or a custom kernel: the user's choice stays
    AttentionInterface.register(GQA_SDPA, sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return config._attn_implementation == GQA_SDPA
