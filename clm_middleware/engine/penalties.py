"""Repetition controls as logits processors: ``f(generated_ids, logits [vocab]) -> logits``.

Each one looks only at the tokens generated so far in this reply, never at the prompt:
penalising the prompt would punish the model for repeating the user's own facts (an
order number, a name), which is what a managed context exists to keep.

- ``repetition_penalty`` p (CTRL paper; HF ``repetition_penalty``, llama.cpp
  ``repeat_penalty``): each token id already generated gets ``logit / p`` if its logit
  is > 0, else ``logit * p``. 1.0 is off; > 1 discourages repeats.
- ``frequency_penalty`` f and ``presence_penalty`` r (OpenAI semantics, each in
  [-2, 2]): ``logit[j] -= count[j] * f + (count[j] > 0) * r``, where ``count[j]`` is how
  often token j was generated. 0 is off; negative values encourage repeats.
- ``no_repeat_ngram_size`` n (HF semantics): a token that would complete an n-gram
  already present in the generated ids gets ``-inf``. 0 is off; with n = 1 no token
  repeats at all.

Invariants:
- A ``-inf`` logit stays ``-inf`` (a scripted reply forces tokens that way, see
  ``models/scripted.py``, and the engine's own processors run first).
- No processor leaves every logit ``-inf``: when the n-gram ban would ban every
  remaining token, the logits pass unchanged (a forced token wins over the ban).
- Processors never write into the tensor they are given (the engine reads log-probs
  from the raw logits) and keep no state, so concurrent generations can share them.
- Everything is vectorised over the generated ids; nothing loops over the vocabulary.

Caveat: the n-gram ban applies to structured text too (a tool call's JSON, the free-form
``[LIFECYCLE]`` block's ``seg_N: keep`` lines), where repeated n-grams are the format;
a small n can make these impossible to write.

``None`` for ``repetition_penalty`` / ``no_repeat_ngram_size`` means "the model's own
generation config" (``GenerationDefaults.from_model``); OpenAI's two penalties have no
counterpart there and default to 0. ``GenerationDefaults`` also carries the model's
``top_k`` / ``min_p``, which the sampler applies (``engine/sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from clm_middleware.engine.generation import LogitsProcessor
from clm_middleware.errors import ConfigError

MAX_OPENAI_PENALTY = 2.0  # OpenAI's documented range for frequency / presence penalties


class PenaltySettings(Protocol):
    """What ``penalty_processors`` reads (``GenerationSettings``, ``ReplayOptions``)."""

    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def no_repeat_ngram_size(self) -> int | None: ...


def check_penalties(settings: PenaltySettings) -> None:
    """Raise ``ConfigError`` naming the first field out of range (``None`` is allowed)."""
    repetition, ngram = settings.repetition_penalty, settings.no_repeat_ngram_size
    if repetition is not None and not repetition > 0:
        raise ConfigError("repetition_penalty", f"must be > 0 (1.0 is off), got {repetition}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(settings, name)
        if not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
            raise ConfigError(name, f"must be in [-2, 2] (0 is off), got {value}")
    if ngram is not None and ngram < 0:
        raise ConfigError("no_repeat_ngram_size", f"must be ≥ 0 (0 is off), got {ngram}")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The model's own repetition and sampling-filter settings, used where a setting is
    ``None``. Every default is "off", as for a model whose config sets nothing
    (transformers ≥ 5 leaves unset ``top_k`` / ``min_p`` at ``None``, not 50)."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.repetition_penalty > 0:
            raise ConfigError("generation_config.repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ConfigError("generation_config.no_repeat_ngram_size", f"must be ≥ 0, got {self.no_repeat_ngram_size}")
        if self.top_k < 0:
            raise ConfigError("generation_config.top_k", f"must be ≥ 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError("generation_config.min_p", f"must be in [0, 1], got {self.min_p}")

    @classmethod
    def from_model(cls, model: Any) -> GenerationDefaults:
        """Read ``model.generation_config``; a missing or unset value is off."""
        config = getattr(model, "generation_config", None)
        repetition = getattr(config, "repetition_penalty", None)
        ngram = getattr(config, "no_repeat_ngram_size", None)
        top_k = getattr(config, "top_k", None)
        min_p = getattr(config, "min_p", None)
        return cls(
            repetition_penalty=1.0 if repetition is None else float(repetition),
            no_repeat_ngram_size=0 if ngram is None else int(ngram),
            top_k=0 if top_k is None else int(top_k),
            min_p=0.0 if min_p is None else float(min_p),
        )


@dataclass(frozen=True, slots=True)
class RepetitionPenalty:
    penalty: float

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not generated:
            return logits
        ids = torch.unique(torch.tensor(generated, device=logits.device))
        picked = logits[ids]
        return logits.index_put((ids,), torch.where(picked > 0, picked / self.penalty, picked * self.penalty))


@dataclass(frozen=True, slots=True)
class CountPenalty:
    """OpenAI's frequency and presence penalties in one pass."""

    frequency: float
    presence: float

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not generated:
            return logits
        ids, counts = torch.unique(torch.tensor(generated, device=logits.device), return_counts=True)
        penalty = counts.to(logits.dtype) * self.frequency + self.presence
        return logits.index_put((ids,), logits[ids] - penalty)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


@dataclass(frozen=True, slots=True)
class LogitBias:
    """OpenAI's ``logit_bias``: a fixed bias added to given tokens' logits at every step."""

    bias: tuple[tuple[int, float], ...]

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([token for token, _ in self.bias], device=logits.device)
        values = torch.tensor([value for _, value in self.bias], dtype=logits.dtype, device=logits.device)
        return logits.index_put((ids,), logits[ids] + values)


def check_logit_bias(bias: tuple[tuple[Any, Any], ...], vocab_size: int | None = None) -> None:
    """``ConfigError`` naming ``logit_bias`` for a token id that is not one (or outside
    ``vocab_size``) or a bias outside [-100, 100]."""
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError("logit_bias", f"keys must be token ids (integers ≥ 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError("logit_bias", f"biases must be numbers, got {value!r} for token {token}")
        if vocab_size is not None and token >= vocab_size:
            raise ConfigError("logit_bias", f"token id {token} is outside the vocabulary (size {vocab_size})")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ConfigError("logit_bias", f"biases must be in [-100, 100], got {value} for token {token}")


@dataclass(frozen=True, slots=True)
class NoRepeatNgram:
    size: int

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(generated) < self.size:
            return logits
        ids = torch.tensor(generated, device=logits.device)
        windows = ids.unfold(0, self.size, 1)  # every n-gram so far, [count, n]
        prefix = ids[len(generated) - self.size + 1 :]  # the n-1 tokens the next one would extend
        banned = windows[(windows[:, :-1] == prefix).all(dim=1), -1]
        if banned.numel() == 0:
            return logits
        shaped = logits.index_put((banned,), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        if not bool((shaped > float("-inf")).any()):
            return logits  # banning would leave nothing to choose: the ban yields
        return shaped


def penalty_processors(
    settings: PenaltySettings, defaults: GenerationDefaults | None = None
) -> tuple[LogitsProcessor, ...]:
    """The processors ``settings`` ask for, ``None`` resolved against ``defaults``;
    ``()`` when every control is off, so the default path costs nothing."""
    defaults = defaults or GenerationDefaults()
    repetition = settings.repetition_penalty
    repetition = defaults.repetition_penalty if repetition is None else repetition
    ngram = settings.no_repeat_ngram_size
    ngram = defaults.no_repeat_ngram_size if ngram is None else ngram
    processors: list[LogitsProcessor] = []
    if repetition != 1.0:
        processors.append(RepetitionPenalty(repetition))
    if settings.frequency_penalty or settings.presence_penalty:
        processors.append(CountPenalty(settings.frequency_penalty, settings.presence_penalty))
    if ngram > 0:
        processors.append(NoRepeatNgram(ngram))  # last: its fallback sees the final logits
    return tuple(processors)
