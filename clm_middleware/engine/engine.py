"""Generation through the block pool: reuse the longest cached prefix, compute the rest once.

One call (``Engine.generate``) does, in order::

    prompt ids ──hash──▶ block keys ──match──▶ cached chain (acquired)   ┐ bookkeeping_s
                                      allocate blocks for the rest       │
    gather chain K/V ──▶ the request's arena (see cache/arena.py)       ┘
    prefill the uncached tail ──▶ decode (streamed)                        compute
    store the new full blocks (prompt and generated) ──▶ release / hold  ─ bookkeeping_s

Invariants:
- At least one prompt token is always recomputed, even when the whole prompt is
  cached: the first generated token needs the last position's logits, and
  transformers re-feeds the whole prompt when the cache already covers it.
- Blocks are reserved for ``prompt + max_new_tokens`` before any computation, so a
  request that cannot fit fails at once with ``PoolExhaustedError`` and never
  half-way through decoding.
- Only positions whose K/V were actually computed are stored (after decoding, the
  cache holds prompt + generated − 1 tokens); only full blocks are stored.
- A call that fails with an exception stores nothing and releases everything it
  took; a stream closed early by its consumer stores what it computed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from clm_middleware.cache.arena import ArenaCache, ArenaRecycler
from clm_middleware.cache.block_pool import BlockPool
from clm_middleware.cache.hashing import BlockKey, chain_keys, extra_key_bytes
from clm_middleware.cache.layout import KVLayout, PoolConfig
from clm_middleware.engine.sampling import SamplingParams, choose_token
from clm_middleware.engine.stats import CallStats, EngineStats
from clm_middleware.errors import ConfigError, ContextWindowError, PoolExhaustedError
from clm_middleware.models.fingerprint import model_fingerprint


class Generation(Iterator[int]):
    """A running generation: iterate for generated token ids as they are decoded.

    After the iteration ends, ``token_ids``, ``stats`` and ``finish_reason`` are final.
    With ``hold_blocks=True`` the caller owns one reference on each of ``block_ids``
    (the stored chain covering the prompt and generated tokens, in order) and must
    give it back with ``engine.pool.release(reversed(block_ids))``.
    """

    def __init__(self, engine: Engine, request: _Request) -> None:
        self.prompt_token_ids = request.prompt
        self.token_ids: list[int] = []
        self.stats = CallStats(prompt_tokens=len(request.prompt))
        self.finish_reason: str | None = None
        self.block_ids: list[int] = []
        self.last_block_key: BlockKey | None = None
        self.logits: list[torch.Tensor] = []  # with return_logits: one [vocab] row per generated token
        self._tokenizer = engine.tokenizer
        self._steps = engine._run(request, self)

    def __next__(self) -> int:
        return next(self._steps)

    def result(self) -> Generation:
        """Run to the end and return self."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop early; what was computed so far is still stored."""
        self._steps.close()

    @property
    def text(self) -> str:
        if self._tokenizer is None:
            raise RuntimeError("Generation.text needs an engine created with a tokenizer")
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=True)


class _Request:
    __slots__ = ("extra_key", "hold", "prompt", "return_logits", "sampling", "stop", "stop_ids", "use_pool")

    def __init__(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        stop: tuple[str, ...],
        stop_ids: frozenset[int],
        use_pool: bool,
        extra_key: bytes,
        hold: bool,
        return_logits: bool,
    ) -> None:
        self.prompt, self.sampling, self.stop, self.stop_ids = prompt, sampling, stop, stop_ids
        self.use_pool, self.extra_key, self.hold = use_pool, extra_key, hold
        self.return_logits = return_logits


class Engine:
    """A causal LM plus a :class:`BlockPool`; thread-safe for concurrent ``generate`` calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        pool: BlockPool | None = None,
        pool_config: PoolConfig | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layout = KVLayout.from_model(model)
        if pool is not None and pool.layout != self.layout:
            raise ConfigError("pool", "the pool was built for a different KV layout")
        self.pool = pool or BlockPool(self.layout, pool_config)
        self.fingerprint = model_fingerprint(model)
        self.stats = EngineStats()
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(model.config.vocab_size)
        self.device = self.layout.device
        self.default_stop_ids = _eos_ids(model, tokenizer)
        self._arenas = ArenaRecycler(self.layout, self.pool.block_size)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        pool_config: PoolConfig | None = None,
    ) -> Engine:
        """Load a model and tokenizer (see :func:`load_model`) and wrap them."""
        from clm_middleware.models.loading import load_model, load_tokenizer

        return cls(
            load_model(model, device=device, dtype=dtype),
            load_tokenizer(model),
            pool_config=pool_config,
        )

    @property
    def model_name(self) -> str:
        from clm_middleware.models.loading import model_name

        return model_name(self.model)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def extra_key(self, cache_salt: str | None = None) -> bytes:
        return extra_key_bytes(self.fingerprint, cache_salt)

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
    ) -> Generation:
        """Start a generation; nothing runs until the result is iterated.

        ``stop`` strings end the generation once the decoded text contains one (needs
        a tokenizer); ``stop_token_ids`` default to the model's EOS ids.
        ``use_pool=False`` computes everything from scratch and stores nothing: the
        behaviour of a stateless wrapper, kept for comparison. ``return_logits`` keeps
        the logits each generated token was chosen from (``Generation.logits``).
        """
        prompt = [int(token) for token in prompt_token_ids]
        sampling = SamplingParams(max_new_tokens, temperature, top_p, seed)
        self._validate(prompt, sampling)
        if stop and self.tokenizer is None:
            raise ConfigError("stop", "stop strings need an engine created with a tokenizer")
        stop_ids = self.default_stop_ids if stop_token_ids is None else frozenset(stop_token_ids)
        request = _Request(
            prompt,
            sampling,
            tuple(stop or ()),
            stop_ids,
            use_pool,
            self.extra_key(cache_salt),
            hold_blocks and use_pool,
            return_logits,
        )
        return Generation(self, request)

    def forward(self, token_ids: Sequence[int], cache: Any, *, all_logits: bool = False) -> torch.Tensor:
        """Run the model on ``token_ids`` after what ``cache`` holds; logits ``[tokens, vocab]``."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            output = self.model(
                input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1
            )
        return output.logits[0]

    # -------------------------------------------------------------- internal

    def _validate(self, prompt: list[int], sampling: SamplingParams) -> None:
        if not prompt:
            raise ConfigError("prompt_token_ids", "must hold at least one token")
        bad = next((token for token in prompt if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise ConfigError(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary (size {self.vocab_size})"
            )
        needed = len(prompt) + sampling.max_new_tokens
        if self.max_positions and needed > self.max_positions:
            raise ContextWindowError(
                f"the prompt ({len(prompt)} tokens) plus max_new_tokens "
                f"({sampling.max_new_tokens}) needs {needed} positions; the model has "
                f"{self.max_positions}",
                hint="shorten the prompt, lower max_new_tokens, or set a context budget",
            )

    def _run(self, request: _Request, result: Generation) -> Iterator[int]:
        started = time.perf_counter()
        stats, pool, size = result.stats, self.pool, self.pool.block_size
        prompt, sampling = request.prompt, request.sampling
        chain: list[int] = []  # blocks covering positions 0.., in order, one ref each
        keys: list[BlockKey] = []
        reserved: list[int] = []
        capacity = math.ceil((len(prompt) + sampling.max_new_tokens) / size)
        arena, reusable_blocks = self._arenas.take(capacity, prompt, request.extra_key)
        store = False
        try:
            if request.use_pool:
                tick = time.perf_counter()
                keys = chain_keys(prompt, size, request.extra_key, num_blocks=(len(prompt) - 1) // size)
                chain = pool.match(keys, prompt)
                del keys[len(chain) :]
                try:
                    reserved = pool.allocate(capacity - len(chain))
                except PoolExhaustedError:
                    pool.release(list(reversed(chain)))
                    chain = []
                    raise
                pool.gather_into(chain, arena, skip_blocks=min(reusable_blocks, len(chain)))
                stats.bookkeeping_s += time.perf_counter() - tick
            else:
                arena.reset_to(0)
            stats.cached_tokens = len(chain) * size
            stats.prefill_tokens = len(prompt) - stats.cached_tokens
            store = request.use_pool
            logits = self.forward(prompt[stats.cached_tokens :], arena)[-1]
            generator = sampling.generator(self.device)
            first_token_at = None
            while len(result.token_ids) < sampling.max_new_tokens:
                token = choose_token(logits, sampling, generator)
                if request.return_logits:
                    result.logits.append(logits.detach().float().clone())
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
            else:
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
                self._store(request, result, arena, chain, keys, reserved)
            else:
                pool.release(reserved)
            if store:  # an arena of a failed or stateless call holds nothing reusable
                self._arenas.give(arena, (prompt + result.token_ids)[: arena.num_tokens], request.extra_key)
            else:
                self._arenas.give(arena, [], b"")
            if request.hold:
                result.block_ids = chain
            else:
                pool.release(list(reversed(chain)))
            stats.bookkeeping_s += time.perf_counter() - tick
            stats.finish_reason = result.finish_reason
            stats.total_s = time.perf_counter() - started
            self.stats.add(stats)

    def _store(
        self,
        request: _Request,
        result: Generation,
        arena: ArenaCache,
        chain: list[int],
        keys: list[BlockKey],
        reserved: list[int],
    ) -> None:
        """Copy the newly computed full blocks into reserved blocks and publish them."""
        pool, size = self.pool, self.pool.block_size
        tokens = request.prompt + result.token_ids
        first_new = len(chain)
        parent = keys[-1] if keys else None
        new_keys = chain_keys(
            tokens[: arena.num_tokens], size, request.extra_key, start_block=first_new, parent=parent
        )
        targets = reserved[: len(new_keys)]
        pool.store_from(arena, first_new, targets)
        for offset, (block_id, key) in enumerate(zip(targets, new_keys, strict=True)):
            index = first_new + offset
            block_tokens = tokens[index * size : (index + 1) * size]
            chain.append(pool.commit(block_id, key, parent, block_tokens))
            parent = key
        pool.release(reserved[len(new_keys) :])
        result.stats.stored_blocks = len(new_keys)
        result.last_block_key = parent

    def _hit_stop_string(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return any(marker in text for marker in stop)


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
