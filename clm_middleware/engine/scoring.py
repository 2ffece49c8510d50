"""Transient computations over a cached prefix: constrained choice and continuation scoring.

Both match the prefix in the pool like ``generate`` does (token-exact, see
engine/reuse.py), compute after it in a working arena, and store nothing: their pieces
and candidates are throwaway text, and caching them would only evict useful blocks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from clm_middleware.cache.arena import ArenaCache
from clm_middleware.engine.prefill import forward_chunks, rows_at
from clm_middleware.engine.reuse import PrefixHit, match_prefix

if TYPE_CHECKING:
    from clm_middleware.engine.engine import Engine


@contextlib.contextmanager
def transient_prefix(
    engine: Engine, prefix: list[int], capacity_tokens: int, extra_key: bytes
) -> Iterator[tuple[ArenaCache, PrefixHit]]:
    """An arena whose first ``hit.start`` positions hold ``prefix``'s cached K/V; every
    reference is given back and the arena returned empty on exit."""
    arena, reusable = engine.runner.arenas.take(math.ceil(capacity_tokens / engine.block_size), prefix, extra_key)
    hit = match_prefix(engine.pool, None, prefix, extra_key)
    try:
        hit.gather_into(engine.pool, arena, reusable)
        yield arena, hit
    finally:
        hit.release(engine.pool)
        engine.runner.arenas.give(arena, [], b"")


def choose(
    engine: Engine,
    prefix: list[int],
    pieces: Sequence[Sequence[int]],
    choices: Sequence[int],
    continuations: Sequence[Sequence[int]] | None,
    cache_salt: str | None,
    sequential: bool,
) -> list[tuple[int, list[float]]]:
    """See ``Engine.choose``."""
    tails = [list(c) for c in continuations] if continuations is not None else [[] for _ in choices]
    longest_tail = max((len(t) for t in tails), default=0)
    total = len(prefix) + sum(len(p) for p in pieces) + len(pieces) * (1 + longest_tail)
    engine._validate(prefix, total - len(prefix))
    choice_index = torch.tensor(list(choices), device=engine.device)
    with transient_prefix(engine, prefix, total, engine.extra_key(cache_salt)) as (arena, hit):
        pending = prefix[hit.start :]
        if sequential:
            rows = []
            for piece in pieces:
                logits = forward_chunks(engine.forward, pending + list(piece), arena)
                rows.append(logits)
                index = int(torch.argmax(logits[choice_index]))
                pending = [int(choices[index]), *tails[index]]
        else:
            supplied, positions = list(pending), []
            for piece in pieces:
                supplied += list(piece)
                positions.append(len(supplied) - 1)
                supplied += [int(choices[0]), *tails[0]]
            rows = rows_at(engine.forward, supplied, positions, arena)
    picked = []
    for logits in rows:
        probs = torch.softmax(logits[choice_index].float(), dim=-1)
        picked.append((int(torch.argmax(probs)), probs.tolist()))
    return picked


def score(
    engine: Engine, prefix: list[int], continuations: Sequence[Sequence[int]], cache_salt: str | None
) -> list[float]:
    """See ``Engine.score``."""
    longest = max((len(c) for c in continuations), default=0)
    engine._validate(prefix, longest)
    scores: list[float] = []
    with transient_prefix(engine, prefix, len(prefix) + longest, engine.extra_key(cache_salt)) as (arena, hit):
        last = torch.log_softmax(forward_chunks(engine.forward, prefix[hit.start :], arena).float(), dim=-1)
        base = arena.num_tokens
        for continuation in continuations:
            tokens = [int(t) for t in continuation]
            arena.reset_to(base)
            total = float(last[tokens[0]]) if tokens else 0.0
            if len(tokens) > 1:
                rows = torch.log_softmax(engine.forward(tokens[:-1], arena, all_logits=True).float(), dim=-1)
                total += float(rows.gather(1, torch.tensor(tokens[1:], device=rows.device)[:, None]).sum())
            scores.append(total)
    return scores
