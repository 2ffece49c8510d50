"""Generation through the block pool: reuse the longest cached prefix, compute the rest once.

One call (``Engine.generate``) does, in order::

    prompt ids ──hash──▶ block keys ──match──▶ cached chain + tail (acquired) ┐ bookkeeping_s
                                      allocate blocks for the rest            │
    gather chain K/V ──▶ the request's arena (see cache/arena.py)            ┘
      (paged_kv: no gather; the model attends over the pool blocks, cache/paged.py)
    prefill the uncached tokens (in chunks) ──▶ decode (streamed)               compute
    store the new blocks (prompt and generated) ──▶ release / hold            ─ bookkeeping_s

Reuse is token-exact (see engine/reuse.py): a turn that extends the previous one
computes only the tokens it adds. An engine built with ``blend=BlendConfig()`` also
reuses, approximately and labelled as such, the K/V of text that a compaction moved
(engine/blend.py); its approximate K/V never enter the pool.

Invariants:
- At least one prompt token is always recomputed, even when the whole prompt is
  cached: the first generated token needs the last position's logits, and a model
  fed an empty input has nothing to return them from.
- Blocks are reserved for ``prompt + max_new_tokens`` before any computation, so a
  request that cannot fit fails at once with ``PoolExhaustedError`` and never
  half-way through decoding.
- Only positions whose K/V were actually computed are stored (after decoding, the
  cache holds prompt + generated − 1 tokens); the last block stored may be partial.
- A call that fails with an exception stores nothing and releases everything it
  took; a stream closed early by its consumer stores what it computed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from clm_middleware.cache.arena import ArenaRecycler
from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.disk import DEFAULT_MIN_FREE_DISK_MB, DiskStats, DiskTier
from clm_middleware.cache.hashing import extra_key_bytes
from clm_middleware.cache.layout import KVLayout, PoolConfig
from clm_middleware.cache.paged import PagedCache, WorkingCache
from clm_middleware.engine import scoring
from clm_middleware.engine.attention import use_gqa_attention
from clm_middleware.engine.blend import BlendConfig, Blender, approximate_start, observed_from
from clm_middleware.engine.generation import Generation, LogitsProcessor, Request, request_ids
from clm_middleware.engine.observe import Observe, default_probe_layers
from clm_middleware.engine.penalties import GenerationDefaults
from clm_middleware.engine.prefill import force, prefill
from clm_middleware.engine.reuse import PrefixHit, match_prefix, store_computed
from clm_middleware.engine.sampling import SamplingParams, check_sampling_filters, choose_token
from clm_middleware.engine.stats import EngineStats
from clm_middleware.errors import ConfigError, ContextWindowError, PoolExhaustedError
from clm_middleware.models.fingerprint import model_fingerprint

_NO_OBSERVATION = Observe()


class Engine:
    """A causal LM plus a :class:`BlockPool`; thread-safe for concurrent calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        pool: BlockPool | None = None,
        pool_config: PoolConfig | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        disk_cache_dir: str | Path | None = None,
        min_free_disk_mb: int = DEFAULT_MIN_FREE_DISK_MB,
        max_disk_bytes: int | None = None,
        gqa_attention: bool = True,
        blend: BlendConfig | None = None,
        paged_kv: bool = False,
    ) -> None:
        if paged_kv and blend is not None:
            raise ConfigError(
                "paged_kv", "approximate reuse moves K/V inside a working arena; it cannot run with paged_kv"
            )
        self.model = model.eval()
        # attend over the pool's blocks in place (cache/paged.py): the context is held once,
        # for a gather of one layer per layer per forward; False: a working arena copy
        self.paged_kv = paged_kv
        # opt-in approximate reuse after a compaction (engine/blend.py); None: token-exact only
        self.blend = blend
        self._blender = Blender(model, blend) if blend is not None else None
        # grouped-query attention without repeat_kv copies (engine/attention.py); exact
        self.gqa_attention = use_gqa_attention(model) if gqa_attention else False
        self.logits_processors = tuple(logits_processors)  # applied to every call, before the call's own
        self.tokenizer = tokenizer
        self.layout = KVLayout.from_model(model)
        if pool is not None and pool.layout != self.layout:
            raise ConfigError("pool", "the pool was built for a different KV layout")
        self.pool = pool or BlockPool(self.layout, pool_config)
        self.fingerprint = model_fingerprint(model)
        self.stats = EngineStats()
        # one-off measurements of this model, by the module that measures (e.g. the
        # protocol calibration, lifecycle/calibration.py): per engine, never global
        self.memo: dict[str, Any] = {}
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(model.config.vocab_size)
        self.device = self.layout.device
        self.default_stop_ids = _eos_ids(model, tokenizer)
        self.probe_layers = default_probe_layers(self.layout.num_layers)
        # Share of a forward's FLOPs spent in the LM head, per position: lets the engine
        # report what computing every position's logits (for log-probs) adds.
        hidden = int(getattr(model.config, "hidden_size", 0) or 0)
        head_flops = hidden * self.vocab_size
        self._lm_head_share = head_flops / max(1, self.num_parameters) if hidden else 0.0
        self._arenas = ArenaRecycler(self.layout, self.pool.block_size)
        self.disk: DiskTier | None = None
        if disk_cache_dir is not None:
            self.disk = DiskTier(
                disk_cache_dir, self.fingerprint, min_free_disk_mb=min_free_disk_mb, max_bytes=max_disk_bytes
            )
            self.pool.add_eviction_listener(self.disk.write)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        pool_config: PoolConfig | None = None,
        blend: BlendConfig | None = None,
        paged_kv: bool = False,
    ) -> Engine:
        """Load a model and tokenizer (see :func:`load_model`) and wrap them."""
        from clm_middleware.models.loading import load_model, load_tokenizer

        return cls(
            load_model(model, device=device, dtype=dtype),
            load_tokenizer(model),
            pool_config=pool_config,
            blend=blend,
            paged_kv=paged_kv,
        )

    def close(self) -> None:
        """Spill every cached block to the disk tier (if any), so a restart hits from disk."""
        if self.disk is None or not self.disk.enabled:
            return
        for block in self.pool.cached_blocks():
            if len(block.token_ids) < self.block_size:
                continue  # a partial tail: the disk tier keeps full blocks only
            keys, values = self.pool.read_block(block.block_id)
            self.disk.write(block.key, block.parent_key, block.token_ids, keys, values)  # skips files it has

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def disk_stats(self) -> dict[str, int]:
        """``disk_hits``, ``disk_writes``, ``disk_skipped_writes``, ``disk_corrupt`` (zeros without a disk tier)."""
        return (self.disk.stats if self.disk is not None else DiskStats()).as_dict()

    @property
    def model_name(self) -> str:
        from clm_middleware.models.loading import model_name

        return model_name(self.model)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.model.parameters())

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's own repetition and sampling-filter settings (``model.generation_config``), read live."""
        return GenerationDefaults.from_model(self.model)

    def working_kv_bytes(self, num_tokens: int) -> int:
        """K/V bytes a request over ``num_tokens`` positions holds beside the pool: a whole
        copy in a working arena; one layer's scratch with ``paged_kv``."""
        copy = num_tokens * self.layout.bytes_per_token
        return copy // self.layout.num_layers if self.paged_kv else copy

    def extra_key(self, cache_salt: str | None = None) -> bytes:
        # blocks stored rounded (PoolConfig.kv_dtype) are other K/V than exact ones: own keys, own disk files
        stored_as = "" if self.pool.exact else f"/kv={str(self.pool.kv_dtype).removeprefix('torch.')}"
        return extra_key_bytes(self.fingerprint + stored_as, cache_salt)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        use_pool: bool = True,
        cache_salt: str | None = None,
        hold_blocks: bool = False,
        return_logits: bool = False,
        observe: Observe | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        forced_token_ids: Sequence[int] | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
    ) -> Generation:
        """Start a generation; nothing runs until the result is iterated.

        ``stop`` strings end the generation once the decoded text contains one (needs
        a tokenizer); ``stop_token_ids`` default to the model's EOS ids.
        ``use_pool=False`` computes everything from scratch and stores nothing: the
        behaviour of a stateless wrapper, kept for comparison. ``return_logits`` keeps
        the logits each generated token was chosen from (``Generation.logits``);
        ``observe`` records self-information and attention mass (see ``Generation``).
        ``cache_salt`` isolates tenants: blocks are shared only under the same salt.
        ``logits_processors`` (``f(generated_ids, logits) -> logits``) reshape the
        next-token logits before sampling, after the engine's own processors;
        log-probs are still read from the model's raw logits.
        ``forced_token_ids`` (teacher forcing) replaces decoding: the given ids are the
        continuation, computed in chunks right after the prompt (``max_new_tokens`` and
        sampling are ignored), their log-probs recorded (``Generation.forced_nll``) and
        their full blocks stored like generated ones, so a next prompt that repeats them
        hits. ``ttft_s`` is still the time to the prompt's last logits: when the first
        token of a generated reply would have been chosen.
        ``top_k`` / ``min_p`` filter sampled tokens (``engine/sampling.py``; 0 is off);
        ``None`` takes the model's generation config. Greedy decoding ignores them.
        """
        prompt, forced = request_ids(prompt_token_ids, forced_token_ids)
        if forced is not None:
            self._check_vocabulary(list(forced), "forced_token_ids")
            max_new_tokens = len(forced)
        check_sampling_filters(top_k, min_p)
        defaults = self.generation_defaults
        sampling = SamplingParams(
            max_new_tokens,
            temperature,
            top_p,
            seed,
            top_k=defaults.top_k if top_k is None else top_k,
            min_p=defaults.min_p if min_p is None else min_p,
        )
        self._validate(prompt, sampling.max_new_tokens)
        if stop and self.tokenizer is None:
            raise ConfigError("stop", "stop strings need an engine created with a tokenizer")
        request = Request(
            prompt=prompt,
            sampling=sampling,
            stop=tuple(stop or ()),
            stop_ids=self.default_stop_ids if stop_token_ids is None else frozenset(stop_token_ids),
            use_pool=use_pool,
            extra_key=self.extra_key(cache_salt),
            hold=hold_blocks and use_pool,
            return_logits=return_logits,
            observe=observe or _NO_OBSERVATION,
            logits_processors=self.logits_processors + tuple(logits_processors),
            forced=forced,
        )
        return Generation(request, self.tokenizer, self._run)

    def choose(
        self,
        prefix_ids: Sequence[int],
        pieces: Sequence[Sequence[int]],
        choices: Sequence[int],
        *,
        continuations: Sequence[Sequence[int]] | None = None,
        cache_salt: str | None = None,
        sequential: bool = True,
    ) -> list[tuple[int, list[float]]]:
        """Constrained continuation: after ``prefix_ids``, feed each piece and pick one of ``choices``.

        ``choices`` are single token ids; ``continuations[choice]`` is the rest of a
        multi-token choice. Returns ``(chosen index, probabilities over choices)`` per
        piece. The prefix is matched in the pool; nothing new is stored (the pieces are
        transient).

        ``sequential=True``: after piece ``i`` the most likely choice is fed before
        piece ``i + 1``, one forward per piece. ``sequential=False``: the whole text is
        supplied with the first choice after every piece and scored in one forward;
        each choice then conditions on that supplied text, not on the model's own
        earlier choices (much cheaper for many pieces).
        """
        return scoring.choose(
            self, [int(t) for t in prefix_ids], pieces, choices, continuations, cache_salt, sequential
        )

    def score(
        self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]], *, cache_salt: str | None = None
    ) -> list[float]:
        """Log-probability of each continuation after ``prefix_ids`` (sum over its tokens).

        The prefix is matched in the pool and computed once; each continuation is
        scored from the same prefix state. Nothing new is stored.
        """
        return scoring.score(self, [int(t) for t in prefix_ids], continuations, cache_salt)

    def forward(
        self,
        token_ids: Sequence[int],
        cache: Any,
        *,
        all_logits: bool = False,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the model on ``token_ids`` after what ``cache`` holds.

        Returns logits ``[positions, vocab]`` for the last position (default), every
        position (``all_logits``), or the given relative positions (``keep``).
        """
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        if keep is not None:
            to_keep: int | torch.Tensor = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        else:
            to_keep = 0 if all_logits else 1
        with torch.no_grad():
            output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=to_keep)
        return output.logits[0]

    # -------------------------------------------------------------- internal

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ConfigError("prompt_token_ids", "must hold at least one token")
        self._check_vocabulary(prompt, "prompt_token_ids")
        needed = len(prompt) + max_new_tokens
        if self.max_positions and needed > self.max_positions:
            raise ContextWindowError(
                f"the prompt ({len(prompt)} tokens) plus max_new_tokens "
                f"({max_new_tokens}) needs {needed} positions; the model has "
                f"{self.max_positions}",
                hint="shorten the prompt, lower max_new_tokens, or set a context budget",
            )

    def _check_vocabulary(self, token_ids: list[int], field: str) -> None:
        bad = next((token for token in token_ids if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise ConfigError(field, f"token id {bad} is outside the vocabulary (size {self.vocab_size})")

    def _prefill(
        self, request: Request, result: Generation, arena: WorkingCache, start: int, hit: PrefixHit
    ) -> torch.Tensor:
        """Compute the prompt from ``start`` on (engine/prefill.py); the last position's logits."""
        done = prefill(
            self.forward,
            self.model,
            request,
            arena,
            start,
            hit,
            self.pool,
            probe_layers=self.probe_layers,
            lm_head_share=self._lm_head_share,
        )
        if request.observe.logprobs:
            result.prompt_logprobs = done.prompt_logprobs
        if request.observe.attention_window:
            result.attention = done.attention
        result.stats.observe_s += done.observe_s
        return done.last_logits

    def _run(self, request: Request, result: Generation) -> Iterator[int]:
        started = time.perf_counter()
        stats, pool, size = result.stats, self.pool, self.pool.block_size
        prompt, sampling = request.prompt, request.sampling
        hit = PrefixHit(size)  # the blocks serving positions 0.., one ref each
        chain: list[int] = []  # after storing: blocks covering every computed position
        reserved: list[int] = []
        capacity = math.ceil((len(prompt) + sampling.max_new_tokens) / size)
        tick = time.perf_counter()
        blending = self._blender is not None and request.use_pool
        paged = self.paged_kv and request.use_pool
        arena: WorkingCache | None = None
        reusable, held = 0, []
        if not paged:
            arena, reusable = self._arenas.take(
                capacity, prompt if request.use_pool else [], request.extra_key, approximate=blending
            )
            held = arena.token_ids  # what the arena held: a blend moves its K/V
        exact_after: int | None = None  # the arena's first approximate position after the call
        copied_until = 0
        stats.arena_s = time.perf_counter() - tick
        store = False
        try:
            if request.use_pool:
                tick = time.perf_counter()
                hit = match_prefix(pool, self.disk, prompt, request.extra_key)
                stats.disk_tokens = hit.disk_tokens
                try:
                    reserved = pool.allocate(capacity - len(hit.chain))
                except PoolExhaustedError:
                    hit.release(pool)
                    raise
                if paged:
                    arena = _paged_cache(pool, hit, reserved)
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
                    self._blender, arena, held, prompt, start=start, reusable=reusable,
                    copied_until=copied_until, limit=limit,
                )  # fmt: skip
                start, exact_after, computed = reused.start, reused.exact_tokens, reused.computed
                stats.approximate_tokens, stats.blend_check_tokens = reused.approximate_tokens, reused.checked
            stats.cached_tokens = start - computed
            stats.prefill_tokens = len(prompt) - stats.cached_tokens
            store = request.use_pool
            logits = self._prefill(request, result, arena, start, hit)
            generator = sampling.generator(self.device)
            first_token_at = None
            if request.forced is not None:
                first_token_at = time.perf_counter()
                stats.ttft_s = first_token_at - started
                result.token_logprobs = force(self.forward, request.forced, logits, arena)
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
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    stats.ttft_s = first_token_at - started
                stats.generated_tokens = len(result.token_ids)
                yield token
                if token in request.stop_ids or self._hit_stop_string(result.token_ids, request.stop):
                    result.finish_reason = "stop"
                    break
                if len(result.token_ids) >= sampling.max_new_tokens:
                    break
                logits = self.forward([token], arena)[-1]
            if first_token_at is None:
                stats.ttft_s = time.perf_counter() - started  # max_new_tokens == 0: prefill only
            result.finish_reason = result.finish_reason or "length"
            if first_token_at is not None:
                stats.decode_s = time.perf_counter() - first_token_at
        except BaseException as error:
            if not isinstance(error, GeneratorExit):
                store = False
            raise
        finally:
            tick = time.perf_counter()
            if store:
                tokens = prompt + result.token_ids
                measured = _measured_logprobs(request, result, len(tokens))
                chain, result.last_block_key = store_computed(
                    pool, hit, arena, tokens, reserved, request.extra_key, measured, exact_after
                )
                stats.stored_blocks = len(chain) - len(hit.chain)
                pool.release([hit.tail] if hit.tail is not None else [])
                if not paged:
                    self._arenas.give(arena, tokens[: arena.num_tokens], request.extra_key, exact_after)
            else:  # an arena of a failed or stateless call holds nothing reusable
                pool.release(reserved)
                chain = hit.blocks
                if not paged:
                    self._arenas.give(arena, [], b"")
            if request.hold:
                result.block_ids = chain
            else:
                pool.release(list(reversed(chain)))
            stats.bookkeeping_s += time.perf_counter() - tick
            stats.finish_reason = result.finish_reason
            stats.total_s = time.perf_counter() - started
            self.stats.add(stats)

    def _hit_stop_string(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return any(marker in text for marker in stop)


def _paged_cache(pool: BlockPool, hit: PrefixHit, reserved: list[int]) -> PagedCache:
    """The request's cache over its hit chain and reserved blocks, in position order. A
    tail hit is copied into the first reserved block (cached blocks are never written:
    copy-on-extend), which the request then extends in place."""
    if hit.tail is not None:
        pool.copy_block(hit.tail, reserved[0])
    return PagedCache(
        pool, [*hit.chain, *reserved], num_tokens=hit.start, writable_from=len(hit.chain) * pool.block_size
    )


def _measured_logprobs(request: Request, result: Generation, num_tokens: int) -> list[float | None] | None:
    """log p of each of prompt + reply tokens given the tokens before it, where this call
    measured it (the model's own distribution, before any sampling shaping)."""
    if not request.observe.logprobs or result.prompt_logprobs is None:
        return None
    reply = list(result.token_logprobs)
    reply = reply if len(reply) == len(result.token_ids) else [None] * len(result.token_ids)
    return (list(result.prompt_logprobs) + reply)[:num_tokens]


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
