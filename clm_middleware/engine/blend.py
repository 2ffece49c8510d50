"""Approximate reuse after a compaction (opt-in): the K/V of retained text, moved.

A compaction changes the context at one point (the digest grows, a message leaves) and
every position after it shifts, so exact reuse recomputes the whole rest of the
context. Blending, after CacheBlend (Yao et al., 2024), instead takes the K/V the
previous call computed for the same token runs and moves them to their new positions::

    held     [ prefix | old digest | msg 3 | msg 4 | msg 5 | reply ]
    prompt   [ prefix | new digest ...... | msg 4 | msg 5 | reply | new message ]
                      ^ start              '-- moved runs ------'  ^ end
    computed            new digest                             new message (prefill)
                        + the ``recompute_share`` of moved positions that deviate most

- Keys are stored rotated (RoPE at position p); a rotation by δ turns them into keys at
  p + δ, which is exact for the rotation itself (positions compose for RoPE types whose
  frequencies do not depend on the length: default, linear, llama3).
- What stays approximate is context: above the first layers a moved token's K/V still
  reflect the text that preceded it before the compaction. CacheBlend's selection runs
  the first ``check_layer + 1`` layers over every position in ``[start, end)`` (a
  ``(check_layer + 1) / num_layers`` share of a prefill), compares the moved tokens'
  K/V there with exact ones, and recomputes the tokens that deviate most, through
  every layer; the first layers are then exact for every position.
- Moved K/V are never stored in the pool or on disk, whose keys promise exact K/V: the
  arena marks the first approximate position (``ArenaCache.exact_tokens``) and serves
  past it only to engines that opted in. A conversation's later turns reuse the arena;
  if another request takes it, the next turn recomputes exactly from the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

import torch

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.prefill import PREFILL_CHUNK_TOKENS
from clm_middleware.errors import ConfigError

ROTATABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})  # frequencies fixed: R(p)·R(δ) = R(p + δ)
# decoders whose forward is embeddings → rotary → layers, as the check pass calls them
BLENDABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """Approximate reuse settings; ``Engine(blend=BlendConfig())`` turns it on.

    ``recompute_share``: of the moved positions, the share recomputed through every
    layer (CacheBlend recomputes 15%). ``min_run_tokens``: shorter matching runs are
    recomputed instead (a run of a few tokens is as likely a coincidence, "the", as
    retained text). ``check_layer``: the layer whose K/V deviation picks what to
    recompute (layer 0's K/V depend on the token and position only, so 1 is the first
    that sees the context).
    """

    recompute_share: float = 0.15
    min_run_tokens: int = 16
    check_layer: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_share <= 1.0:
            raise ConfigError("recompute_share", f"must be in [0, 1], got {self.recompute_share}")
        if self.min_run_tokens < 1:
            raise ConfigError("min_run_tokens", f"must be ≥ 1, got {self.min_run_tokens}")
        if self.check_layer < 0:
            raise ConfigError("check_layer", f"must be ≥ 0, got {self.check_layer}")


@dataclass(frozen=True, slots=True)
class Run:
    """``length`` tokens held at ``old_start`` that the prompt has again at ``new_start``."""

    new_start: int
    old_start: int
    length: int


@dataclass(frozen=True, slots=True)
class Blended:
    """What one blend did over prompt positions ``[start, end)``: ``moved`` positions
    took K/V from the held context (``recomputed`` of them were then computed again),
    the others were computed (``computed``, recomputed included); ``checked`` went
    through the first layers to choose. ``first_approximate``: the first moved position
    left as moved (what precedes it is exact), None if every one was recomputed."""

    start: int
    end: int
    moved: int
    recomputed: int
    computed: int
    checked: int
    first_approximate: int | None

    @property
    def approximate_tokens(self) -> int:
        return self.moved - self.recomputed


def matching_runs(
    held: Sequence[int], held_from: int, prompt: Sequence[int], start: int, end: int, min_run: int
) -> list[Run]:
    """Runs of ``prompt[start:end]`` found, in order, in ``held[held_from:]``, each at
    least ``min_run`` tokens (difflib's longest-matching-blocks, so runs never cross)."""
    matcher = SequenceMatcher(None, list(held[held_from:]), list(prompt[start:end]), autojunk=False)
    return [Run(start + b, held_from + a, n) for a, b, n in matcher.get_matching_blocks() if n >= min_run]


class Blender:
    """Moves held K/V to new positions in an arena and recomputes what it must."""

    def __init__(self, model: torch.nn.Module, config: BlendConfig) -> None:
        inner = getattr(model, "model", model)
        self.rotary = getattr(inner, "rotary_emb", None)
        self.layers = getattr(inner, "layers", None)
        self.embed = getattr(inner, "embed_tokens", None)
        rope_type = getattr(self.rotary, "rope_type", None)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if self.rotary is None or self.layers is None or self.embed is None or rope_type not in ROTATABLE_ROPE_TYPES:
            raise ConfigError(
                "blend",
                f"approximate reuse needs a decoder with rotary positions of a fixed frequency "
                f"({sorted(ROTATABLE_ROPE_TYPES)}); this model has {rope_type or 'none'}",
            )
        if model_type not in BLENDABLE_MODEL_TYPES:
            raise ConfigError(
                "blend", f"approximate reuse supports {sorted(BLENDABLE_MODEL_TYPES)} models, not {model_type}"
            )
        if config.check_layer >= len(self.layers):
            raise ConfigError("check_layer", f"the model has {len(self.layers)} layers, got {config.check_layer}")
        self.model, self.config = model, config
        self.scaling = float(getattr(self.rotary, "attention_scaling", 1.0) or 1.0)

    def blend(
        self, arena: ArenaCache, held: Sequence[int], held_from: int, prompt: Sequence[int], start: int, end: int
    ) -> Blended | None:
        """Fill prompt positions ``[start, end)`` of ``arena`` (which holds ``prompt[:start]``
        exactly and ``held`` at positions ``held_from..len(held)``, untouched); None, and
        nothing changed, when the held context offers no run worth moving."""
        runs = matching_runs(held, held_from, prompt, start, end, self.config.min_run_tokens)
        moved = sum(run.length for run in runs)
        if not runs:
            return None
        device = arena.keys.device
        new = torch.cat([torch.arange(r.new_start, r.new_start + r.length) for r in runs]).to(device)
        old = torch.cat([torch.arange(r.old_start, r.old_start + r.length) for r in runs]).to(device)
        self._move(arena, old, new)
        check = self.config.check_layer
        moved_k = arena.flat_keys[check].index_select(1, new)
        moved_v = arena.flat_values[check].index_select(1, new)
        self._first_layers(arena, prompt, start, end)
        deviation = (arena.flat_keys[check].index_select(1, new) - moved_k).pow(2).sum((0, 2)) + (
            arena.flat_values[check].index_select(1, new) - moved_v
        ).pow(2).sum((0, 2))
        count = min(moved, math.ceil(self.config.recompute_share * moved))
        chosen = new[torch.topk(deviation, count).indices] if count else new[:0]
        covered = torch.zeros(end - start, dtype=torch.bool)
        covered[(new - start).cpu()] = True
        covered[(chosen - start).cpu()] = False
        positions = (torch.nonzero(~covered)[:, 0] + start).tolist()
        self._compute_at(arena, prompt, positions, end)
        arena.reset_to(end)
        left = torch.nonzero(covered)[:, 0]
        first = int(left[0]) + start if len(left) else None
        return Blended(start, end, moved, count, len(positions), end - start, first)

    def _move(self, arena: ArenaCache, old: torch.Tensor, new: torch.Tensor) -> None:
        """Copy every layer's K/V from ``old`` to ``new`` positions, keys re-rotated by the shift."""
        keys = arena.flat_keys.index_select(2, old)  # a copy: sources and targets may overlap
        values = arena.flat_values.index_select(2, old)
        shift = (new - old)[None]
        cos, sin = self.rotary(keys, shift)  # [1, n, head_dim], scaled by attention_scaling
        cos, sin = (cos[0] / self.scaling).to(keys.dtype), (sin[0] / self.scaling).to(keys.dtype)
        half = keys.shape[-1] // 2
        rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)  # transformers' rotate_half
        arena.flat_keys.index_copy_(2, new, keys * cos + rotated * sin)
        arena.flat_values.index_copy_(2, new, values)

    def _first_layers(self, arena: ArenaCache, prompt: Sequence[int], start: int, end: int) -> None:
        """Compute layers ``0..check_layer`` of positions ``[start, end)`` exactly, in place.

        The layers are called as the decoder's own forward calls them (embeddings, rotary
        positions, then each layer), which is why only the families in
        ``BLENDABLE_MODEL_TYPES`` are accepted; no hook goes on the shared model, so
        concurrent calls on other arenas are untouched."""
        device = arena.keys.device
        arena.reset_to(start)
        with torch.no_grad():
            for offset in range(start, end, PREFILL_CHUNK_TOKENS):
                chunk = prompt[offset : min(end, offset + PREFILL_CHUNK_TOKENS)]
                where = torch.arange(offset, offset + len(chunk), device=device)
                hidden = self.embed(torch.tensor([chunk], device=device))
                rotary = self.rotary(hidden, where[None])
                mask = _causal_mask(where, offset + len(chunk), arena.keys.dtype)
                for layer in self.layers[: self.config.check_layer + 1]:
                    hidden = layer(
                        hidden, attention_mask=mask, position_embeddings=rotary, position_ids=where[None], cache=arena
                    )
                arena.reset_to(offset + len(chunk))

    def _compute_at(self, arena: ArenaCache, prompt: Sequence[int], positions: list[int], end: int) -> None:
        """Compute ``positions`` (ascending) through every layer, writing their K/V in
        place; each attends to every position up to its own, moved or computed."""
        for offset in range(0, len(positions), PREFILL_CHUNK_TOKENS):
            chunk = positions[offset : offset + PREFILL_CHUNK_TOKENS]
            with arena.scattered(torch.tensor(chunk, device=arena.keys.device), length=end):
                self._forward(arena, [prompt[p] for p in chunk], chunk, end)

    def _forward(self, arena: ArenaCache, token_ids: list[int], positions: list[int], kv_length: int) -> None:
        device = arena.keys.device
        where = torch.tensor(positions, device=device)
        with torch.no_grad():
            self.model(
                input_ids=torch.tensor([token_ids], device=device),
                position_ids=where[None],
                attention_mask=_causal_mask(where, kv_length, arena.keys.dtype),
                cache=arena,
                use_cache=True,
                logits_to_keep=1,
            )


def _causal_mask(positions: torch.Tensor, kv_length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, queries, kv_length]`` additive mask: a query at position p sees positions ≤ p."""
    allowed = torch.arange(kv_length, device=positions.device)[None, :] <= positions[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass(frozen=True, slots=True)
class ApproximateStart:
    """Where a blending engine's call starts computing, and what it reused approximately.

    ``start``: positions before it are filled (``computed`` of them by the blend).
    ``exact_tokens``: the arena's first approximate position after the call (None: all
    exact). ``approximate_tokens``: positions before ``start`` neither exact nor computed.
    """

    start: int
    exact_tokens: int | None
    approximate_tokens: int = 0
    computed: int = 0
    checked: int = 0


def observed_from(observe: Observe, prompt_tokens: int) -> int:
    """The first prompt position a call must compute exactly in order, for what it
    observes (a log-prob at q needs the logits at q - 1; the attention window's queries),
    and never past the last position."""
    limit = prompt_tokens - 1
    if observe.logprobs:
        wanted = observe.logprob_positions
        if wanted is None:
            return 0
        if wanted:
            limit = min(limit, min(wanted) - 1)
    if observe.attention_window:
        limit = min(limit, prompt_tokens - min(observe.attention_window, prompt_tokens))
    return max(0, limit)


def approximate_start(
    blender: Blender,
    arena: ArenaCache,
    held: Sequence[int],
    prompt: Sequence[int],
    *,
    start: int,
    reusable: int,
    copied_until: int,
    limit: int,
) -> ApproximateStart:
    """Serve ``prompt`` past the exact ``start`` from what ``arena`` held (``held``, of
    which ``reusable`` leading tokens match the prompt), then blend up to ``limit``.

    ``copied_until``: the end of the blocks the pool copied into the arena (their last
    one may hold another continuation past ``start``); held K/V before it are gone.
    """
    held_exact = arena.exact_tokens
    served, first_approximate, approximate = start, None, 0
    if copied_until <= start and reusable > start:
        served = max(start, min(reusable, limit))
        if held_exact is not None and held_exact < served:
            # computed after approximate K/V, however exact the pool made what precedes
            first_approximate = max(held_exact, start)
            approximate = served - first_approximate
        arena.reset_to(served)
    if served >= limit:
        return ApproximateStart(served, first_approximate, approximate)
    blended = blender.blend(arena, held, max(served, copied_until), prompt, served, limit)
    if blended is None:
        return ApproximateStart(served, first_approximate, approximate)
    if first_approximate is None:
        first_approximate = blended.first_approximate
    return ApproximateStart(
        limit, first_approximate, approximate + blended.approximate_tokens, blended.computed, blended.checked
    )
