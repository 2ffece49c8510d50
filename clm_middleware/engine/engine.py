"""Generation through the block pool: reuse the longest cached prefix, compute the rest once.

``Engine`` holds the model, its pool and its disk tier, validates each call and builds
its ``Request``; engine/execution.py runs it (match, gather, prefill, decode, store).

Reuse is token-exact (see engine/reuse.py): a turn that extends the previous one
computes only the tokens it adds. An engine built with ``blend=BlendConfig()`` also
reuses, approximately and labelled as such, the K/V of text that a compaction moved
(engine/blend.py); its approximate K/V never enter the pool. With
``compile_decode=True`` a generated token is decoded by a step compiled ahead of time
(engine/compiled_decode.py): the same computation, fused, equal to float rounding
(bf16 rounding with ``quantization``'s bf16-compute weights).

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

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clm_middleware.cache.block_pool import POOL_HINT, BlockPool
from clm_middleware.cache.disk import DEFAULT_MIN_FREE_DISK_MB, DiskStats, DiskTier
from clm_middleware.cache.hashing import extra_key_bytes
from clm_middleware.cache.layout import KVLayout, PoolConfig
from clm_middleware.cache.paged import PAST_TILE_TOKENS, PagedCache
from clm_middleware.engine import scoring
from clm_middleware.engine.attention import PAGED_CACHE_KWARG, use_gqa_attention
from clm_middleware.engine.blend import BlendConfig
from clm_middleware.engine.compiled_decode import CompiledDecoder, PoolGeometry
from clm_middleware.engine.execution import RequestRunner
from clm_middleware.engine.generation import Generation, LogitsProcessor, Request, request_ids
from clm_middleware.engine.observe import Observe, default_probe_layers
from clm_middleware.engine.penalties import GenerationDefaults
from clm_middleware.engine.sampling import SamplingParams, check_sampling_filters, check_stop_strings
from clm_middleware.engine.stats import EngineStats
from clm_middleware.engine_settings import refuse_paged_approximate_reuse
from clm_middleware.errors import ConfigError, ContextWindowError, PoolTooSmallError
from clm_middleware.models.fingerprint import model_fingerprint
from clm_middleware.models.quantization import parameter_count

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
        compile_decode: bool = False,
        compile_cache_dir: str | Path | None = None,
    ) -> None:
        refuse_paged_approximate_reuse(paged_kv, blend is not None)
        self.model = model.eval()
        # attend over the pool's blocks in place (cache/paged.py): the context is held once,
        # read a tile of one layer at a time (attends_in_place); False: a working arena copy
        self.paged_kv = paged_kv
        # opt-in approximate reuse after a compaction (engine/blend.py); None: token-exact only
        self.blend = blend
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
        # paged_kv with the engine's own attention on CPU reads the pool's blocks a tile at a
        # time (cache/paged.py); else each layer's context is gathered into a one-layer scratch
        # (another attention implementation, or a device without PyTorch's CPU flash kernel)
        self.attends_in_place = paged_kv and self.gqa_attention and self.device.type == "cpu"
        self.default_stop_ids = _eos_ids(model, tokenizer)
        self.probe_layers = default_probe_layers(self.layout.num_layers)
        # Share of a forward's FLOPs spent in the LM head, per position: lets the engine
        # report what computing every position's logits (for log-probs) adds.
        hidden = int(getattr(model.config, "hidden_size", 0) or 0)
        head_flops = hidden * self.vocab_size
        self.lm_head_share = head_flops / max(1, self.num_parameters) if hidden else 0.0
        self.disk: DiskTier | None = None
        if disk_cache_dir is not None:
            self.disk = DiskTier(
                disk_cache_dir, self.fingerprint, min_free_disk_mb=min_free_disk_mb, max_bytes=max_disk_bytes
            )
            self.pool.add_eviction_listener(self.disk.write)
        self.runner = RequestRunner(self, blend)  # executes requests; owns the working arenas
        # opt-in decode step compiled ahead of time (engine/compiled_decode.py); None: the model's forward
        self.decoder: CompiledDecoder | None = None
        if compile_decode:
            # with paged_kv the step reads the pool's blocks in place, compiled for its geometry
            geometry = PoolGeometry(self.pool.kv_dtype, self.pool.block_size) if paged_kv else None
            self.decoder = CompiledDecoder(model, cache_dir=compile_cache_dir, paged=geometry)

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
        quantization: str | None = None,
        compile_decode: bool = False,
    ) -> Engine:
        """Load a model and tokenizer (see :func:`load_model`) and wrap them."""
        from clm_middleware.models.loading import load_model, load_tokenizer

        return cls(
            load_model(model, device=device, dtype=dtype, quantization=quantization),
            load_tokenizer(model),
            pool_config=pool_config,
            blend=blend,
            paged_kv=paged_kv,
            compile_decode=compile_decode,
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
        """``DiskStats.as_dict``: ``disk_hits``, ``disk_writes``, ... (zeros without a disk tier)."""
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
        return parameter_count(self.model)

    @property
    def sees_logits(self) -> bool:
        """Logits processors (grammars, a caller's function) run on this engine's own logits."""
        return True

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's own repetition and sampling-filter settings (``model.generation_config``), read live."""
        return GenerationDefaults.from_model(self.model)

    def working_kv_bytes(self, num_tokens: int, *, pooled: bool = True) -> int:
        """K/V bytes a request over ``num_tokens`` positions holds beside the pool: a whole
        copy in a working arena (every request without ``paged_kv``, and an unpooled one,
        ``use_pool=False``, with it); with ``paged_kv`` one layer's scratch, or in place one
        tile of one layer (``PAST_TILE_TOKENS`` positions at most), at the model's dtype."""
        copy = num_tokens * self.layout.bytes_per_token
        if not (self.paged_kv and pooled):
            return copy
        if self.attends_in_place:
            return min(num_tokens, PAST_TILE_TOKENS) * self.layout.bytes_per_token // self.layout.num_layers
        return copy // self.layout.num_layers

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
        # a forced reply's tokens are what follows the prompt, whatever max_new_tokens says
        after = "the forced reply" if forced is not None else "max_new_tokens"
        self._validate(prompt, sampling.max_new_tokens, after)
        if use_pool:
            self._check_pool_fits(len(prompt) + sampling.max_new_tokens, sampling.max_new_tokens, after)
        if stop and self.tokenizer is None:
            raise ConfigError("stop", "stop strings need an engine created with a tokenizer")
        check_stop_strings(stop)
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
        # the generation holds its engine (not the runner): a temporary engine lives while its generation runs
        return Generation(request, self.tokenizer, functools.partial(self.runner.run, self))

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
        in_place = isinstance(cache, PagedCache) and cache.attend_in_place
        extra = {PAGED_CACHE_KWARG: cache} if in_place else {}
        with torch.no_grad():
            output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=to_keep, **extra)
        if in_place:
            cache.check_past_read()
        return output.logits[0]

    def decode(self, token: int, cache: Any) -> torch.Tensor:
        """Next-token logits ``[vocab]`` after feeding one generated ``token`` into ``cache``:
        the compiled step where it serves the cache (``compile_decode``), else :meth:`forward`."""
        if self.decoder is not None and self.decoder.serves(cache):
            return self.decoder.step(token, cache)
        return self.forward([token], cache)[-1]

    # -------------------------------------------------------------- internal

    def _validate(self, prompt: list[int], max_new_tokens: int, after: str = "max_new_tokens") -> None:
        if not prompt:
            raise ConfigError("prompt_token_ids", "must hold at least one token")
        self._check_vocabulary(prompt, "prompt_token_ids")
        needed = len(prompt) + max_new_tokens
        if self.max_positions and needed > self.max_positions:
            lower = "lower max_new_tokens, " if after == "max_new_tokens" else ""
            raise ContextWindowError(
                f"the prompt ({len(prompt)} tokens) plus {after} "
                f"({max_new_tokens}) needs {needed} positions; the model has "
                f"{self.max_positions}",
                hint=f"shorten the prompt, {lower}or set a context budget",
            )

    def _check_pool_fits(self, positions: int, max_new_tokens: int, after: str = "max_new_tokens") -> None:
        """A pooled request reserves blocks for every position at once (its hit blocks
        included): more than the whole pool is never served, whatever is released."""
        needed = -(-positions // self.block_size)
        if needed > self.pool.num_blocks:
            raise PoolTooSmallError(
                f"the prompt plus {after} ({max_new_tokens}) needs {positions} positions in "
                f"{needed} KV blocks of {self.block_size} tokens; the pool has {self.pool.num_blocks} in all",
                hint=POOL_HINT,
            )

    def _check_vocabulary(self, token_ids: list[int], field: str) -> None:
        bad = next((token for token in token_ids if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise ConfigError(field, f"token id {bad} is outside the vocabulary (size {self.vocab_size})")


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
