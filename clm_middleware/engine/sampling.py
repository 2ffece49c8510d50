"""Next-token choice: greedy at temperature 0, else temperature sampling with optional
top-k, nucleus (top-p) and min-p filters.

The filters follow Hugging Face transformers' warpers (``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) and run in transformers' order, each on the
distribution the previous one left (renormalised), after the temperature:

1. ``top_k`` k: keep the k highest logits (ties with the k-th are kept too). 0 is off.
2. ``top_p`` p: keep the smallest set of most likely tokens whose mass reaches p. 1 is off.
3. ``min_p`` m: drop every token whose probability is below ``m × max probability``, so
   the cut scales with how confident the model is (Nguyen et al., 2024). 0 is off.

Invariants: the most likely token always survives every filter, so a choice is always
possible; greedy decoding (temperature 0) ignores every filter, since the argmax is in
each kept set anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from clm_middleware.errors import ConfigError


def check_sampling_filters(top_k: int | None, min_p: float | None) -> None:
    """Raise ``ConfigError`` naming ``top_k`` or ``min_p`` when out of range (``None`` is allowed:
    it means the model's generation config)."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError("top_k", f"must be an integer ≥ 0 (0 is off), got {top_k!r}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ConfigError("min_p", f"must be in [0, 1] (0 is off), got {min_p}")


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def check_seed(seed: int | None) -> None:
    """Raise ``ConfigError`` naming ``seed`` unless it is None or an integer torch can seed with."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError("seed", f"must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def generator_seed(seed: int) -> int:
    """What the generator is seeded with for ``seed``: itself in [0, 2**32), where torch's
    CPU generator reads every bit; a 32-bit hash of it elsewhere. The generator keeps only
    the low 32 bits, so -1, 2**63 - 1 and 2**64 - 1 had sampled alike (a sweep through clm
    serve); hashed, two seeds share a stream only by chance, as any two 32-bit seeds may."""
    if 0 <= seed < 2**32:
        return seed
    return xxhash.xxh32_intdigest(seed.to_bytes(9, "little", signed=True))


def check_stop_strings(stop: Sequence[str] | None, field: str = "stop") -> None:
    """Raise ``ConfigError`` naming ``field`` unless each is a non-empty string ("" is in
    every text: it would end each reply at its first token)."""
    for marker in stop or ():
        if not isinstance(marker, str) or not marker:
            raise ConfigError(field, f"each stop string must be a non-empty string, got {marker!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling settings of one request (no ``None``: defaults are applied by the engine)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError("max_new_tokens", f"must be ≥ 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN too
            raise ConfigError("temperature", f"must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_sampling_filters(self.top_k, self.min_p)
        check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether any of top-k, top-p, min-p narrows the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(generator_seed(self.seed))
        return generator


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from last-position ``logits`` (shape ``[vocab]``)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if not params.filtered:
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
    sorted_probs, order = sorted_distribution(scores, params)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return int(order[choice])


def sorted_distribution(scores: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities, token ids)`` in descending order of ``scores`` (temperature applied),
    with the tokens the filters remove at probability 0; the rest are renormalised."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    if 0 < params.top_k < probs.numel():
        # as TopKLogitsWarper: everything below the k-th score goes, ties with it stay
        probs = _renormalised(probs.masked_fill(sorted_scores < sorted_scores[params.top_k - 1], 0.0))
    if params.top_p < 1.0:
        cumulative = torch.cumsum(probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        probs = _renormalised(probs.masked_fill(cumulative - probs >= params.top_p, 0.0))
    if params.min_p > 0.0:
        probs = _renormalised(probs.masked_fill(probs < params.min_p * probs[0], 0.0))
    return probs, order


def _renormalised(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum()
