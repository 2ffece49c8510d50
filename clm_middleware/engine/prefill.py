"""Computing prompt positions into a working cache (arena or paged), in chunks, with what a call asked to observe.

Invariants:
- Chunks hold at most ``PREFILL_CHUNK_TOKENS`` positions, which bounds activation memory
  (logits alone: chunk × vocabulary floats); chunking changes no logit beyond float noise.
- A log-prob at position q is log p(prompt[q] | prompt[:q]); positions the pool served
  keep the log-probs their computing call measured (``PrefixHit.cached_logprobs``).
- The observation's own cost (extra LM-head rows, log-softmax, attention probe) is
  reported apart (``Prefilled.observe_s``), so compute and observation can be told apart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.paged import WorkingCache
from clm_middleware.engine.generation import Request
from clm_middleware.engine.observe import AttentionProbe
from clm_middleware.engine.reuse import PrefixHit

PREFILL_CHUNK_TOKENS = 256

# Engine.forward: logits of the last position, every position (all_logits) or the kept ones
Forward = Callable[..., torch.Tensor]


@dataclass
class Prefilled:
    last_logits: torch.Tensor
    prompt_logprobs: list[float | None] | None = None
    attention: Any = None
    observe_s: float = 0.0


def forward_chunks(forward: Forward, token_ids: Sequence[int], arena: WorkingCache) -> torch.Tensor:
    """Feed ``token_ids`` in chunks; logits of the last position."""
    logits = None
    for start in range(0, len(token_ids), PREFILL_CHUNK_TOKENS):
        logits = forward(token_ids[start : start + PREFILL_CHUNK_TOKENS], arena)[-1]
    assert logits is not None, "forward_chunks needs at least one token"
    return logits


def rows_at(forward: Forward, token_ids: list[int], positions: list[int], arena: WorkingCache) -> list[torch.Tensor]:
    """Feed ``token_ids`` in chunks; the logits rows at ``positions`` (relative to ``token_ids``)."""
    rows: list[torch.Tensor] = []
    for offset in range(0, len(token_ids), PREFILL_CHUNK_TOKENS):
        chunk = token_ids[offset : offset + PREFILL_CHUNK_TOKENS]
        wanted = [p - offset for p in positions if offset <= p < offset + len(chunk)]
        logits = forward(chunk, arena, keep=wanted or [len(chunk) - 1])
        if wanted:
            rows.extend(logits[i] for i in range(len(wanted)))
    return rows


def force(forward: Forward, forced: Sequence[int], last_logits: torch.Tensor, arena: WorkingCache) -> list[float]:
    """Feed all but the last forced token (the arena then holds prompt + forced − 1, as
    after decoding); log p of every forced token, the first from ``last_logits``."""
    rows = [last_logits[None].float()]
    body = list(forced[:-1])
    for offset in range(0, len(body), PREFILL_CHUNK_TOKENS):
        rows.append(forward(body[offset : offset + PREFILL_CHUNK_TOKENS], arena, all_logits=True).float())
    logits = torch.cat(rows)
    target = torch.tensor(list(forced), device=logits.device)[:, None]
    return (logits.gather(1, target)[:, 0] - torch.logsumexp(logits, dim=-1)).tolist()


def prefill(
    forward: Forward,
    model: torch.nn.Module,
    request: Request,
    arena: WorkingCache,
    start: int,
    hit: PrefixHit,
    pool: BlockPool,
    *,
    probe_layers: tuple[int, ...],
    lm_head_share: float,
) -> Prefilled:
    """Compute the prompt from position ``start`` on, with the log-probs and attention
    ``request.observe`` asks for. ``lm_head_share``: the LM head's share of a forward's
    FLOPs per position, to charge the extra rows to the observation."""
    prompt, observe = request.prompt, request.observe
    if not observe.logprobs and not observe.attention_window:
        return Prefilled(forward_chunks(forward, prompt[start:], arena))
    logprobs: list[float | None] = [None] * len(prompt)
    if observe.logprobs:
        logprobs = hit.cached_logprobs(pool, len(prompt))
        if start == hit.start and start > 0:
            logprobs[start] = hit.known_logprob(pool, prompt)
    wanted = observe.logprob_positions
    probe = AttentionProbe(model, observe.attention_layers or probe_layers)
    last = None
    extra = 0.0
    with probe if observe.attention_window else contextlib.nullcontext():
        for offset in range(start, len(prompt), PREFILL_CHUNK_TOKENS):
            chunk = prompt[offset : offset + PREFILL_CHUNK_TOKENS]
            if not observe.logprobs:
                last = forward(chunk, arena)[-1]
                continue
            # logits at position q predict token q + 1; the last row also feeds sampling
            scored = [q for q in range(offset, offset + len(chunk) - 1) if wanted is None or q + 1 in wanted]
            tick = time.perf_counter()
            logits = forward(chunk, arena, keep=[q - offset for q in scored] + [len(chunk) - 1])
            spent = time.perf_counter() - tick
            last = logits[-1]
            tick = time.perf_counter()
            targets = [prompt[q + 1] for q in scored]
            if offset + len(chunk) < len(prompt) and (wanted is None or offset + len(chunk) in wanted):
                scored.append(offset + len(chunk) - 1)  # the chunk's last row predicts the next chunk's first token
                targets.append(prompt[offset + len(chunk)])
            if scored:
                rows = logits[: len(targets)].float()
                target = torch.tensor(targets, device=rows.device)[:, None]
                picked = rows.gather(1, target)[:, 0] - torch.logsumexp(rows, dim=-1)
                for q, value in zip(scored, picked.tolist(), strict=True):
                    logprobs[q + 1] = value
            # the LM head on the scored rows instead of one: its share of the forward
            extra += time.perf_counter() - tick + spent * lm_head_share * len(scored) / max(1, len(chunk))
    assert last is not None
    result = Prefilled(last, prompt_logprobs=logprobs if observe.logprobs else None)
    if observe.attention_window:
        tick = time.perf_counter()
        result.attention = probe.attention_mass(arena.layer_keys, len(prompt), observe.attention_window)
        extra += time.perf_counter() - tick
    result.observe_s = extra
    return result
