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

The same function attends over a paged cache's pool blocks in place (cache/paged.py,
``attend_in_place``): the engine passes the cache as the forward's
:data:`PAGED_CACHE_KWARG`, which transformers hands every attention call; the layer's
``update`` gave only this forward's fresh K/V, and the past is read from the pool a
tile at a time. Each part runs PyTorch's CPU flash kernel, which also returns the
rows' log-sum-exp (``_scaled_dot_product_flash_attention_for_cpu``; it broadcasts K/V
heads itself), and the parts merge exactly: with ``o_i``, ``l_i`` a part's output and
log-sum-exp, ``o = Σ exp(l_i − L) o_i`` where ``L = logaddexp_i l_i``. The fresh part is
the square causal block (a forward's queries are its fresh positions); past tiles are
unmasked. The engine runs one sequence with no padding, so that is the whole mask.
Logits match a gathered attention's within float noise (tests/unit/test_paged_kv.py).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from clm_middleware.cache.paged import PagedCache

GQA_SDPA = "clm_sdpa_gqa"
PAGED_CACHE_KWARG = "clm_paged_cache"  # a forward's kwarg: the attend-in-place PagedCache it runs on
MERGE_PARTS = 8  # attention parts held before they are merged into one: bounds their memory


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
    paged: PagedCache | None = kwargs.pop(PAGED_CACHE_KWARG, None)
    if paged is not None and (past := paged.take_past(module.layer_idx)):
        return _attend_paged(module, query, key, value, attention_mask, paged, past, dropout, scaling, kwargs)
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


def _attend_paged(
    module: torch.nn.Module,
    query: torch.Tensor,
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: PagedCache,
    past: int,
    dropout: float,
    scaling: float | None,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` (this forward's fresh positions, after ``past`` cached
    ones) over the pool's positions ``0..past`` and the fresh K/V, tile by tile."""
    layer = module.layer_idx
    if query.device.type != "cpu" or kwargs.get("softcap") or kwargs.get("position_bias") is not None:
        # not this kernel's case: gather the whole past for the general path (a transient copy)
        tiles = list(cache.past_tiles(layer, past, query.dtype))
        keys = torch.cat([*(k for k, _ in tiles), fresh_keys], dim=2)
        values = torch.cat([*(v for _, v in tiles), fresh_values], dim=2)
        return sdpa_attention_forward(
            module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    parts = [_flash_cpu(query, fresh_keys, fresh_values, True, scale=scaling)]
    for keys, values in cache.past_tiles(layer, past, query.dtype):
        parts.append(_flash_cpu(query, keys, values, False, scale=scaling))
        if len(parts) == MERGE_PARTS:
            parts = [_merge(parts)]
    output, _ = _merge(parts)
    return output.to(query.dtype).transpose(1, 2).contiguous(), None


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One (output, log-sum-exp) pair for attention parts over disjoint key sets, in fp32
    whatever the model's dtype (one rounding at the end)."""
    outputs = torch.stack([output for output, _ in parts]).float()  # [parts, 1, heads, q, dim]
    lses = torch.stack([lse for _, lse in parts]).float()  # [parts, 1, heads, q]
    lse = torch.logsumexp(lses, dim=0)
    return (outputs * torch.exp(lses - lse).unsqueeze(-1)).sum(dim=0), lse


def _flash_cpu(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, *, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention: output ``[1, heads, q, dim]`` and the rows'
    log-sum-exp ``[1, heads, q]``; K/V heads broadcast over their query groups."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, causal, scale=scale)


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
