"""The result object of one ``Engine.generate`` call, and the request it carries."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clm_middleware.cache.hashing import BlockKey
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.sampling import SamplingParams
from clm_middleware.engine.stats import CallStats
from clm_middleware.errors import ConfigError

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""``f(generated token ids so far, next-token logits [vocab]) -> logits``."""


def request_ids(
    prompt_token_ids: Sequence[int], forced_token_ids: Sequence[int] | None
) -> tuple[list[int], tuple[int, ...] | None]:
    """A generate call's prompt and forced continuation as plain ints (``None``: decode);
    a forced continuation must hold at least one token (every engine's contract)."""
    prompt = [_token_id(token, "prompt_token_ids") for token in prompt_token_ids]
    forced = None if forced_token_ids is None else tuple(_token_id(t, "forced_token_ids") for t in forced_token_ids)
    if forced is not None and not forced:
        raise ConfigError("forced_token_ids", "must hold at least one token")
    return prompt, forced


def _token_id(token: Any, field: str) -> int:
    """An integer id (numpy's and torch's integer scalars too); ``2.5`` or ``"7"`` is no id."""
    try:
        whole = operator.index(token)
    except TypeError:
        raise ConfigError(field, f"token ids must be integers, got {token!r}") from None
    return int(whole)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    use_pool: bool
    extra_key: bytes
    hold: bool
    return_logits: bool
    observe: Observe
    logits_processors: tuple[LogitsProcessor, ...] = ()
    forced: tuple[int, ...] | None = None  # teacher forcing: the continuation is given


class Generation(Iterator[int]):
    """A running generation: iterate for generated token ids as they are decoded.

    After the iteration ends, ``token_ids``, ``stats`` and ``finish_reason`` are final.
    With ``hold_blocks=True`` the caller owns one reference on each of ``block_ids``
    (the stored chain covering the prompt and generated tokens, in order) and must
    give it back with ``engine.pool.release(reversed(block_ids))``.

    With ``observe.logprobs``: ``prompt_logprobs[i]`` is ``log p(prompt[i] | prompt[:i])``
    for every position the call computed (``None`` for positions served from the pool
    and for position 0), and ``token_logprobs[j]`` the same for generated token ``j``.
    With ``observe.attention_window``: ``attention[i]`` is the mean attention the last
    window positions paid to position ``i`` (sums to 1 over the prompt).

    With ``forced_token_ids`` (teacher forcing), ``token_ids`` are the given ids and
    ``token_logprobs[j]`` is ``log p(forced[j] | prompt, forced[:j])`` from the model's
    raw logits, always recorded: ``forced_nll`` is their negated mean.
    """

    def __init__(self, request: Request, tokenizer: Any, steps_factory) -> None:
        self.request = request
        self.prompt_token_ids = request.prompt
        self.token_ids: list[int] = []
        self.stats = CallStats(prompt_tokens=len(request.prompt))
        self.finish_reason: str | None = None
        self.block_ids: list[int] = []
        self.last_block_key: BlockKey | None = None
        self.logits: list[torch.Tensor] = []  # with return_logits: one [vocab] row per generated token
        self.prompt_logprobs: list[float | None] | None = None
        self.token_logprobs: list[float] = []
        self.attention: torch.Tensor | None = None
        # set by the caller before iterating: asked by the engine before each prefill chunk
        # and while it waits on a remote server, so that a caller who went away does not
        # wait for a long prompt; ``TurnCancelled`` then ends the iteration. Its optional
        # ``waiting()`` is asked instead while a remote server has not answered yet
        self.cancelled: Callable[[], bool] | None = None
        self.abandoned = False  # set by abandon(): nothing more is computed for this call
        self._tokenizer = tokenizer
        self._steps = steps_factory(request, self)

    def __next__(self) -> int:
        return next(self._steps)

    def result(self) -> Generation:
        """Run to the end and return self."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop early, the reply complete as it stands (a token cap, a repeat): what was
        computed so far is still stored, and the prompt's asked-for signals still come."""
        self._steps.close()

    def abandon(self) -> None:
        """Stop early for a caller that undoes its turn: stored as ``close()`` does, but an
        engine computes nothing more for it (a remote engine's scorer skips the prompt)."""
        self.abandoned = True
        self._steps.close()

    def stopped(self) -> bool:
        """Whether the last generated token ends the reply: an end-of-turn id, or it
        completes a stop string. A caller that ends the iteration at a token cap asks this
        first: a reply that ends exactly at the cap finished with "stop", not "length"."""
        if not self.token_ids:
            return False
        if self.token_ids[-1] in self.request.stop_ids:
            return True
        if not self.request.stop or self._tokenizer is None:
            return False
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return any(marker in text for marker in self.request.stop)

    @property
    def forced_nll(self) -> float | None:
        """Mean negative log-likelihood per token of a forced continuation (None otherwise)."""
        if self.request.forced is None or not self.token_logprobs:
            return None
        return -sum(self.token_logprobs) / len(self.token_logprobs)

    @property
    def text(self) -> str:
        if self._tokenizer is None:
            raise RuntimeError("Generation.text needs an engine created with a tokenizer")
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
