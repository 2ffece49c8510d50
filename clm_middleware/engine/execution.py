"""One request's execution: match the pool, prefill the rest, decode, store.

``Engine.generate`` validates a call and builds its ``Request``; ``RequestRunner.run``
carries it out, in order::

    prompt ids ──hash──▶ block keys ──match──▶ cached chain + tail (acquired) ┐ bookkeeping_s
                                      allocate blocks for the rest            │
    gather chain K/V ──▶ the request's arena (see cache/arena.py)            ┘
      (paged_kv: no gather; the model attends over the pool blocks, cache/paged.py)
    prefill the uncached tokens (in chunks) ──▶ decode (streamed)               compute
    store the new blocks (prompt and generated) ──▶ release / hold            ─ bookkeeping_s

The runner owns what requests share beyond the pool: the recycled working arenas
(an arena that held this conversation's last turn serves the next without a gather)
and the opt-in blender (engine/blend.py). It reads the engine only through its public
attributes (model, pool, disk tier, ``forward``).

It keeps the invariants listed in engine/engine.py: they are this module's to hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from clm_middleware.cache.arena import ArenaRecycler
from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.paged import PagedCache, WorkingCache
from clm_middleware.engine.blend import BlendConfig, Blender, approximate_start, observed_from
from clm_middleware.engine.generation import Generation, Request
from clm_middleware.engine.prefill import force, prefill
from clm_middleware.engine.reuse import PrefixHit, match_prefix, store_computed
from clm_middleware.engine.sampling import choose_token
from clm_middleware.errors import PoolExhaustedError, TurnCancelled

if TYPE_CHECKING:
    from clm_middleware.engine.engine import Engine


class RequestRunner:
    """Runs the requests of one :class:`Engine`; thread-safe as the engine is (the pool
    and the arena recycler lock; a request's arena is its own while it runs).

    The engine owns its runner and the runner keeps no reference back (each call is given
    its engine): a dropped engine (pool, arenas, disk tier) is freed at once, not at some
    later cycle collection, so a process making engine after engine stays flat."""

    def __init__(self, engine: Engine, blend: BlendConfig | None) -> None:
        self.arenas = ArenaRecycler(engine.layout, engine.pool.block_size)
        # opt-in approximate reuse after a compaction; None: token-exact only
        self.blender = Blender(engine.model, blend) if blend is not None else None

    def _prefill(
        self, engine: Engine, request: Request, result: Generation, arena: WorkingCache, start: int, hit: PrefixHit
    ) -> torch.Tensor:
        """Compute the prompt from ``start`` on (engine/prefill.py); the last position's
        logits. Before each chunk it asks the call's ``cancelled``: a caller who went away
        does not wait for a long prompt (``TurnCancelled``)."""

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            if result.cancelled is not None and result.cancelled():
                raise TurnCancelled("the turn was cancelled by its caller while its prompt was computed")
            return engine.forward(*args, **kwargs)

        done = prefill(
            forward,
            engine.model,
            request,
            arena,
            start,
            hit,
            engine.pool,
            probe_layers=engine.probe_layers,
            lm_head_share=engine.lm_head_share,
        )
        if request.observe.logprobs:
            result.prompt_logprobs = done.prompt_logprobs
        if request.observe.attention_window:
            result.attention = done.attention
        result.stats.observe_s += done.observe_s
        return done.last_logits

    def run(self, engine: Engine, request: Request, result: Generation) -> Iterator[int]:
        """Execute ``request`` on ``engine``, the one owning this runner (see the module
        docstring); yields each token as it is chosen."""
        started = time.perf_counter()
        stats, pool, size = result.stats, engine.pool, engine.pool.block_size
        prompt, sampling = request.prompt, request.sampling
        hit = PrefixHit(size)  # the blocks serving positions 0.., one ref each
        chain: list[int] = []  # after storing: blocks covering every computed position
        reserved: list[int] = []
        capacity = math.ceil((len(prompt) + sampling.max_new_tokens) / size)
        tick = time.perf_counter()
        blending = self.blender is not None and request.use_pool
        paged = engine.paged_kv and request.use_pool
        arena: WorkingCache | None = None
        reusable, held = 0, []
        if not paged:
            arena, reusable = self.arenas.take(
                capacity, prompt if request.use_pool else [], request.extra_key, approximate=blending
            )
            held = arena.token_ids  # what the arena held: a blend moves its K/V
        exact_after: int | None = None  # the arena's first approximate position after the call
        first_token_at: float | None = None
        last_token_at = 0.0  # when the last token was chosen (decode_s: first to last)
        copied_until = 0
        stats.arena_s = time.perf_counter() - tick
        store = False
        try:
            if request.use_pool:
                tick = time.perf_counter()
                hit = match_prefix(pool, engine.disk, prompt, request.extra_key)
                stats.disk_tokens = hit.disk_tokens
                try:
                    reserved = pool.allocate(capacity - len(hit.chain))
                except PoolExhaustedError:
                    hit.release(pool)
                    raise
                if paged:
                    arena = _paged_cache(pool, hit, reserved, in_place=engine.attends_in_place)
                else:
                    # the pool's exact blocks replace what the arena holds approximately
                    exact_reusable = reusable if arena.exact_tokens is None else min(reusable, arena.exact_tokens)
                    copied_until = hit.gather_into(pool, arena, exact_reusable)
                stats.bookkeeping_s += time.perf_counter() - tick
            else:
                arena.reset_to(0)
            start = hit.start
            if request.observe.logprobs and start > 0 and hit.known_logprob(pool, prompt) is None:
                # Recompute one cached token so the first new token's log p comes
                # from its own context: one token of extra work.
                start -= 1
                arena.reset_to(start)
            window = min(request.observe.attention_window, len(prompt))
            if window and start > len(prompt) - window:
                # the attention window's queries are computed by this call, however much
                # of it the pool holds: the observation never depends on the cache
                start = len(prompt) - window
                arena.reset_to(start)
            computed = 0
            if blending and start < (limit := observed_from(request.observe, len(prompt))):
                reused = approximate_start(
                    self.blender, arena, held, prompt, start=start, reusable=reusable,
                    copied_until=copied_until, limit=limit,
                )  # fmt: skip
                start, exact_after, computed = reused.start, reused.exact_tokens, reused.computed
                stats.approximate_tokens, stats.blend_check_tokens = reused.approximate_tokens, reused.checked
            stats.cached_tokens = start - computed
            stats.prefill_tokens = len(prompt) - stats.cached_tokens
            store = request.use_pool
            logits = self._prefill(engine, request, result, arena, start, hit)
            generator = sampling.generator(engine.device)
            if request.forced is not None:
                first_token_at = time.perf_counter()
                stats.ttft_s = first_token_at - started
                result.token_logprobs = force(engine.forward, request.forced, logits, arena)
                result.token_ids.extend(request.forced)
                stats.forced_tokens = len(request.forced)
                yield from request.forced
            while request.forced is None and len(result.token_ids) < sampling.max_new_tokens:
                shaped = logits
                for processor in request.logits_processors:
                    shaped = processor(result.token_ids, shaped)
                token = choose_token(shaped, sampling, generator)
                if request.return_logits:
                    result.logits.append(shaped.detach().float().clone())
                if request.observe.logprobs:
                    tick = time.perf_counter()
                    result.token_logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
                    stats.observe_s += time.perf_counter() - tick
                result.token_ids.append(token)
                last_token_at = time.perf_counter()
                if first_token_at is None:
                    first_token_at = last_token_at
                    stats.ttft_s = first_token_at - started
                stats.generated_tokens = len(result.token_ids)
                yield token
                if result.stopped():
                    result.finish_reason = "stop"
                    break
                if len(result.token_ids) >= sampling.max_new_tokens:
                    break
                logits = engine.decode(token, arena)
            if first_token_at is None:
                stats.ttft_s = time.perf_counter() - started  # max_new_tokens == 0: prefill only
            result.finish_reason = result.finish_reason or "length"
        except BaseException as error:
            if not isinstance(error, GeneratorExit):
                store = False
            raise
        finally:
            tick = time.perf_counter()
            if first_token_at is not None and request.forced is None:  # also on a stream closed early
                stats.decode_s = last_token_at - first_token_at  # one token: 0
            if store:
                tokens = prompt + result.token_ids
                measured = _measured_logprobs(request, result, len(tokens))
                chain, result.last_block_key = store_computed(
                    pool, hit, arena, tokens, reserved, request.extra_key, measured, exact_after
                )
                stats.stored_blocks = len(chain) - len(hit.chain)
                pool.release([hit.tail] if hit.tail is not None else [])
                if not paged:
                    self.arenas.give(arena, tokens[: arena.num_tokens], request.extra_key, exact_after)
            else:  # an arena of a failed or stateless call holds nothing reusable
                pool.release(reserved)
                chain = hit.blocks
                if not paged:
                    self.arenas.give(arena, [], b"")
            if request.hold:
                result.block_ids = chain
            else:
                pool.release(list(reversed(chain)))
            stats.bookkeeping_s += time.perf_counter() - tick
            stats.finish_reason = result.finish_reason
            stats.total_s = time.perf_counter() - started
            engine.stats.add(stats)


def _paged_cache(pool: BlockPool, hit: PrefixHit, reserved: list[int], *, in_place: bool) -> PagedCache:
    """The request's cache over its hit chain and reserved blocks, in position order. A
    tail hit is copied into the first reserved block (cached blocks are never written:
    copy-on-extend), which the request then extends in place."""
    if hit.tail is not None:
        pool.copy_block(hit.tail, reserved[0])
    return PagedCache(
        pool,
        [*hit.chain, *reserved],
        num_tokens=hit.start,
        writable_from=len(hit.chain) * pool.block_size,
        attend_in_place=in_place,
    )


def _measured_logprobs(request: Request, result: Generation, num_tokens: int) -> list[float | None] | None:
    """log p of each of prompt + reply tokens given the tokens before it, where this call
    measured it (the model's own distribution, before any sampling shaping)."""
    if not request.observe.logprobs or result.prompt_logprobs is None:
        return None
    reply = list(result.token_logprobs)
    reply = reply if len(reply) == len(result.token_ids) else [None] * len(result.token_ids)
    return (list(result.prompt_logprobs) + reply)[:num_tokens]
