"""What the prefill lets us observe for free: token self-information and attention mass.

Self-information of a token is ``-log p(token | everything before it)``, read from the
logits the prefill computes anyway (no extra forward). Attention mass is what the
newest tokens' queries (an observation window, as in SnapKV / H2O) put on every
earlier position, computed from the keys already in the cache for a few layers.

The window's queries are recomputed from the attention module's own inputs, captured
with a forward pre-hook (``nn.Module``'s public hook API; nothing in the model is
patched): ``q_proj`` (and ``q_norm`` where the model has one) on the window's hidden
states, then the model family's own ``apply_rotary_pos_emb``. A model whose attention
modules do not look like that gets no attention signal (``supported`` is False), and
callers fall back to the other signals.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from clm_middleware.errors import ConfigError

DEFAULT_WINDOW = 32  # SnapKV's observation window size


@dataclass(frozen=True, slots=True)
class Observe:
    """What a generation call should record about its prompt."""

    logprobs: bool = False  # per-token log p of the prompt's uncached part, and of generated tokens
    logprob_positions: frozenset[int] | None = None  # score only these prompt positions (None: all)
    attention_window: int = 0  # > 0: attention mass of the last N prompt tokens over all positions
    attention_layers: tuple[int, ...] | None = None  # None: three layers in the upper half

    def __post_init__(self) -> None:
        if self.attention_window < 0:
            raise ConfigError("attention_window", f"must be ≥ 0, got {self.attention_window}")


def default_probe_layers(num_layers: int) -> tuple[int, ...]:
    """Three layers at 1/2, 2/3 and 5/6 depth: past the lexical layers, before the last."""
    picks = {max(0, min(num_layers - 1, round(num_layers * f))) for f in (1 / 2, 2 / 3, 5 / 6)}
    return tuple(sorted(picks))


class AttentionProbe:
    """Captures the inputs of chosen attention layers during one prefill."""

    def __init__(self, model: torch.nn.Module, layers: tuple[int, ...]) -> None:
        self.modules = _attention_modules(model)
        self.layers = tuple(layer for layer in layers if 0 <= layer < len(self.modules or []))
        self.supported = (
            bool(self.modules)
            and bool(self.layers)
            and all(_has_query_path(self.modules[layer]) for layer in self.layers)
        )
        self._captured: dict[int, list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._handles: list[Any] = []
        self._thread: int | None = None

    def __enter__(self) -> AttentionProbe:
        # Hooks sit on the shared model: every thread's forward passes through them.
        # Capture only this thread's calls, so concurrent generations never mix.
        self._thread = threading.get_ident()
        if self.supported:
            for layer in self.layers:
                self._handles.append(self.modules[layer].register_forward_pre_hook(self._hook(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        # torch registers (and removes) a with_kwargs hook in two steps: another thread's
        # forward running between them calls it as a plain hook, without kwargs. Such a
        # call is never this thread's (it registers before its own forward), so it is ignored.
        def capture(module, args, kwargs=None):
            if threading.get_ident() != self._thread or kwargs is None:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            position = kwargs.get("position_embeddings")
            if position is None and len(args) > 1:
                position = args[1]
            self._captured.setdefault(layer, []).append((hidden.detach(), position))

        return capture

    def attention_mass(
        self, layer_keys: Callable[[int], torch.Tensor], num_tokens: int, window: int
    ) -> torch.Tensor | None:
        """Mean attention of the last ``window`` positions' queries over positions ``0..num_tokens``.

        The window shrinks to the positions this call computed (a pool hit may leave
        fewer new positions than ``window``).

        ``layer_keys(layer)`` gives a layer's cached keys, ``[kv_heads, tokens, head_dim]``
        (``ArenaCache.layer_keys``, ``PagedCache.layer_keys``).
        Returns a ``[num_tokens]`` float tensor that sums to 1, or None if unsupported.
        """
        if not self.supported or not self._captured:
            return None
        # Only positions computed by this call were captured: the window cannot reach further back.
        computed = sum(h.shape[1] for h, _ in self._captured.get(self.layers[0], []))
        window = max(1, min(window, num_tokens, computed))
        total: torch.Tensor | None = None
        for layer in self.layers:
            chunks = self._captured.get(layer)
            if not chunks:
                return None
            hidden = torch.cat([h for h, _ in chunks], dim=1)[:, -window:]
            cos = torch.cat([p[0] for _, p in chunks], dim=1)[:, -window:]
            sin = torch.cat([p[1] for _, p in chunks], dim=1)[:, -window:]
            queries = _queries(self.modules[layer], hidden, cos, sin)  # [1, heads, window, dim]
            keys = layer_keys(layer)[:, :num_tokens].unsqueeze(0).to(queries.dtype)  # [1, kv_heads, n, dim]
            batch, heads, _, dim = queries.shape
            # query heads h·g .. h·g + g − 1 read K/V head h: grouped, no repeated copy of the keys
            grouped = queries.reshape(batch, keys.shape[1], -1, dim)  # [1, kv_heads, groups · window, dim]
            scores = torch.matmul(grouped, keys.transpose(-1, -2)).view(batch, heads, window, num_tokens)
            scores = scores.float() * _scaling(self.modules[layer], queries)
            positions = torch.arange(num_tokens, device=scores.device)
            query_positions = torch.arange(num_tokens - window, num_tokens, device=scores.device)
            causal = positions[None, :] > query_positions[:, None]
            scores = scores.masked_fill(causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            mass = probs.mean(dim=(0, 1, 2))
            total = mass if total is None else total + mass
        return None if total is None else total / len(self.layers)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    modules = [getattr(layer, "self_attn", None) for layer in layers]
    return modules if all(m is not None for m in modules) else None


def _has_query_path(module: torch.nn.Module) -> bool:
    return hasattr(module, "q_proj") and hasattr(module, "head_dim") and _rotary(module) is not None


def _rotary(module: torch.nn.Module):
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)


def _scaling(module: torch.nn.Module, queries: torch.Tensor) -> float:
    return float(getattr(module, "scaling", queries.shape[-1] ** -0.5))


def _queries(module: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        batch, length, _ = hidden.shape
        queries = module.q_proj(hidden).view(batch, length, -1, module.head_dim)
        if hasattr(module, "q_norm"):
            queries = module.q_norm(queries)
        queries = queries.transpose(1, 2)
        rotated, _ = _rotary(module)(queries, queries, cos, sin)
        return rotated
