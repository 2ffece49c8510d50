"""``RemoteEngine``: the lifecycle layer in front of a serving engine (vLLM, SGLang, llama.cpp).

One call (``RemoteEngine.generate``)::

    prompt ids ─▶ [scorer prefill: self-information, attention]      only if asked and no server signal
               ─▶ POST /v1/completions {prompt: ids, stream, cache_prompt, id_slot}
               ◀─ events: token ids (+ log p) as decoded ─▶ yielded
               ◀─ last event: usage.prompt_tokens_details.cached_tokens / timings.cache_n

Invariants:
- Prompts are token ids, never text, and replies are kept as the ids the server
  generated (``logprobs.content[].id`` on llama.cpp, ``token_ids`` on vLLM): the
  next prompt starts with exactly what the server's cache holds. The ids llama.cpp
  withholds inside a multi-byte character are put back from the bytes
  (``token_bytes.py``; its ``timings.predicted_n`` says how many).
- The server owns the KV cache: ``pool`` is a ``NullPool``, ``block_ids`` are empty,
  and ``cached_tokens`` is what the server says it reused (0 if it says nothing).
- A reply the server breaks off raises ``RemoteEngineError``; nothing is retried
  after the first token, so no token is ever delivered twice.
- ``score`` / ``choose`` and prompt self-information need log-probabilities of given
  tokens: from a local scorer model (``remote/scorer.py``: exact when it shares the
  served model's tokenizer, aligned by characters when it has its own: LLMLingua's
  approach), or, asked for with ``signals="server"``, from vLLM's ``prompt_logprobs``
  (which costs that request vLLM's prefix cache); ``signals_source`` says which.
  Attention mass is never the server's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from clm_middleware.cache.disk import DiskStats
from clm_middleware.engine.generation import Generation, LogitsProcessor, Request, request_ids
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.penalties import GenerationDefaults
from clm_middleware.engine.sampling import SamplingParams, check_sampling_filters, check_stop_strings
from clm_middleware.engine.stats import EngineStats
from clm_middleware.errors import ConfigError, ContextWindowError
from clm_middleware.remote.client import ClientConfig, RemoteEngineError, ServerClient
from clm_middleware.remote.completion import CompletionEvent, completion_body, parse_event, penalty_fields
from clm_middleware.remote.null_pool import NullPool
from clm_middleware.remote.scorer import AlignedScorer, SameTokenizerScorer, make_scorer
from clm_middleware.remote.server_info import TOKENIZER_PROBE, ServerInfo, check_tokenizer, read_server_info
from clm_middleware.remote.signals import SIGNALS
from clm_middleware.remote.slots import SlotTable
from clm_middleware.remote.token_bytes import TokenBytes
from clm_middleware.render.chat_format import ChatFormat

log = logging.getLogger(__name__)

ENGINE_SCHEME = "openai:"  # --engine openai:URL
_NO_OBSERVATION = Observe()


def parse_engine_url(spec: str) -> str:
    """``openai:http://host:port`` (or a bare ``http(s)://`` URL) → the server's base URL, without ``/v1``."""
    url = spec[len(ENGINE_SCHEME) :] if spec.startswith(ENGINE_SCHEME) else spec
    if not url.startswith(("http://", "https://")):
        raise ConfigError("engine", f"expected openai:http://HOST:PORT, got {spec!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class RemoteEngine:
    """Satisfies ``engine.protocol.ServingEngine`` over HTTP; thread-safe for concurrent calls."""

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        *,
        model: str | None = None,
        api_key: str | None = None,
        scorer: Any = None,
        signals: str = "auto",
        client_config: ClientConfig | None = None,
    ) -> None:
        if signals not in SIGNALS:
            raise ConfigError("signals", f"unknown source {signals!r}; use one of {SIGNALS}")
        self.url = parse_engine_url(url)
        self.client = ServerClient(client_config or ClientConfig(self.url, api_key))
        self.info: ServerInfo = read_server_info(self.client, model)
        self.tokenizer = tokenizer
        if signals == "server" and self.info.dialect != "vllm":
            raise ConfigError(
                "engine_signals",
                f"server prompt log-probabilities come from vLLM only; this {self.info.dialect} server returns none",
                hint="use auto (a local scorer) or none",
            )
        self.tokenizer_checked = check_tokenizer(self.client, self.info, tokenizer)
        self.scorer: SameTokenizerScorer | AlignedScorer | None = None
        self._signals = signals
        self.pool = NullPool()
        self.memo: dict[str, Any] = {}
        self._token_bytes: TokenBytes | None = None  # built on the first withheld token
        self.stats = EngineStats()
        self.logits_processors: tuple[LogitsProcessor, ...] = ()
        self.vocab_size = len(tokenizer)
        self.max_positions = self.info.context_tokens
        self.default_stop_ids = _eos_ids(tokenizer)
        self.slots = SlotTable(self.info.num_slots, generation_prompt_length=_generation_prompt_length(tokenizer))
        probe = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        identity = f"{self.info.dialect}|{self.info.model_id}|{self.vocab_size}|{probe}"
        self.fingerprint = "remote-" + xxhash.xxh64(identity.encode()).hexdigest()
        if scorer is not None:
            self.use_scorer(scorer)

    def use_scorer(self, scorer: Any) -> None:
        """Score prompts (self-information, ``score``, ``choose``) with this local engine:
        position by position when it tokenizes as the served model does, else aligned by
        characters (``remote/scorer.py``; ``choose`` then refuses)."""
        self.scorer = make_scorer(self.tokenizer, scorer)

    @property
    def wants_scorer(self) -> bool:
        """Whether signals would come from a scorer, were one given."""
        return self._signals in ("auto", "scorer")

    # ---------------------------------------------------------- description

    @property
    def model_name(self) -> str:
        """For reports: the served id, a file path shortened to its name (llama.cpp serves the GGUF's path)."""
        return self.info.model_id.rsplit("/", 1)[-1] or self.info.model_id

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_parameters(self) -> int:
        """The served model's size where the server says (llama.cpp), else 0: ``compression="auto"``
        then takes the small-model path (extractive); pass ``abstractive`` for a large served model."""
        return self.info.num_parameters

    @property
    def sees_logits(self) -> bool:
        """The server samples; only the penalties it has fields for reach it (``penalty_fields``)."""
        return False

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """Neutral: the server applies its own model's defaults."""
        return GenerationDefaults()

    @property
    def signals_source(self) -> str:
        """``server`` only when asked for, on vLLM: its V1 engine skips the prefix cache for
        any request with ``prompt_logprobs``, so every turn would re-prefill in full."""
        if self._signals == "server" and self.info.dialect == "vllm":
            return "server"
        if self._signals in ("auto", "scorer") and self.scorer is not None:
            return f"scorer:{self.scorer.model_name}"
        return "none"

    def describe(self) -> dict[str, Any]:
        """For reports: which server, what it is, where signals come from."""
        return {
            "engine_url": self.url,
            "dialect": self.info.dialect,
            "model": self.info.model_id,
            "slots": self.info.num_slots,
            "context_tokens": self.info.context_tokens,
            "tokenizer_checked": self.tokenizer_checked,
            "signals_source": self.signals_source,
            "scorer_alignment": None if self.scorer is None else ("characters" if self.scorer.aligned else "tokens"),
        }

    def working_kv_bytes(self, num_tokens: int, *, pooled: bool = True) -> int:
        """The server's KV is not ours to count (reports show 0)."""
        return 0

    def close(self) -> None:
        """Nothing to spill: the server keeps its cache (the HTTP connections stay open for reuse)."""

    def disk_stats(self) -> dict[str, int]:
        """Every disk total at zero: the server keeps its own cache, this side has no disk tier."""
        return DiskStats().as_dict()

    # ------------------------------------------------------------ generation

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
        """As ``Engine.generate``; ``use_pool=False`` asks the server not to reuse its cache
        (llama.cpp ``cache_prompt: false``; vLLM and SGLang decide server-side).
        ``cache_salt`` goes to vLLM as its ``cache_salt``; on llama.cpp a slot's cache is
        reused only by the salt that filled it (``remote/slots.py``): either way tenants
        share no cached prefix. Other servers have no such field (see docs/deploy.md)."""
        if return_logits:
            raise ConfigError("return_logits", "a remote engine does not return logits")
        prompt, forced = request_ids(prompt_token_ids, forced_token_ids)
        check_sampling_filters(top_k, min_p)
        check_stop_strings(stop)
        extra = penalty_fields(logits_processors, self.info.dialect)
        if stop_token_ids is not None:
            extra["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if cache_salt is not None and self.info.dialect == "vllm":
            extra["cache_salt"] = cache_salt
        elif cache_salt is not None and not self.info.num_slots:
            _warn_once(self, "shared_cache", "the engine at %s has no cache salt: tenants share its cached prefixes")
        sampling = SamplingParams(
            len(forced) if forced else max_new_tokens, temperature, top_p, seed, top_k=top_k or 0, min_p=min_p or 0.0
        )
        self._validate(prompt, sampling.max_new_tokens)
        request = Request(
            prompt=prompt,
            sampling=sampling,
            stop=tuple(stop or ()),
            stop_ids=self.default_stop_ids if stop_token_ids is None else frozenset(stop_token_ids),
            use_pool=use_pool,
            extra_key=b"",
            hold=False,
            return_logits=False,
            observe=observe or _NO_OBSERVATION,
            forced=forced,
        )
        fields = {"extra": extra, "top_k": top_k, "min_p": min_p, "salt": cache_salt}
        return Generation(request, self.tokenizer, lambda req, result: self._run(req, result, fields))

    def score(
        self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]], *, cache_salt: str | None = None
    ) -> list[float]:
        """Scored by the local scorer (the served model's log-probabilities of given tokens
        are not exposed by every server)."""
        return self._need_scorer("score").score(prefix_ids, continuations, cache_salt=cache_salt)

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
        """Constrained labels, read from the local scorer's logits (see ``score``)."""
        return self._need_scorer("choose").choose(
            prefix_ids, pieces, choices, continuations=continuations, cache_salt=cache_salt, sequential=sequential
        )

    # -------------------------------------------------------------- internal

    def _need_scorer(self, what: str) -> SameTokenizerScorer | AlignedScorer:
        if self.scorer is None:
            raise ConfigError(
                "scorer",
                f"{what} needs log-probabilities of given tokens, which this engine only has from a local scorer",
                hint="give RemoteEngine(scorer=...) a small local Engine (--engine-scorer)",
            )
        return self.scorer

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ConfigError("prompt_token_ids", "must hold at least one token")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ConfigError("prompt_token_ids", f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        needed = len(prompt) + max_new_tokens
        if self.max_positions and needed > self.max_positions:
            raise ContextWindowError(
                f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) needs {needed} "
                f"positions; the engine serves {self.max_positions} per request",
                hint="shorten the prompt, lower max_new_tokens, or set a context budget",
            )

    def _observe_locally(self, request: Request, result: Generation) -> None:
        """Self-information (and attention) of the prompt, and a forced reply's log p,
        from the scorer: its own pool makes this a prefill of the new tokens only."""
        observe, forced = request.observe, request.forced
        wants = observe.logprobs or observe.attention_window
        if self.scorer is None or self.signals_source == "server" or not (wants or forced):
            return
        tick = time.perf_counter()
        scored = self.scorer.observe(request.prompt, observe, forced)
        result.prompt_logprobs = scored.prompt_logprobs
        result.attention = scored.attention
        if forced and scored.token_logprobs is not None:
            result.token_logprobs = list(scored.token_logprobs)
        result.stats.observe_s += time.perf_counter() - tick

    def _run(self, request: Request, result: Generation, fields: dict[str, Any]) -> Iterator[int]:
        started = time.perf_counter()
        stats = result.stats
        forced = request.forced
        if forced is None and request.sampling.max_new_tokens == 0 and self.signals_source != "server":
            # the prompt's signals alone (the compressor scoring its candidates): the scorer
            # has them; a request would prefill on the server for nothing and take a slot
            # from a conversation (its record overwritten: the next turn missed the cache)
            stats.prompt_tokens = stats.prefill_tokens = len(request.prompt)  # the scorer's prefill
            self._observe_locally(request, result)
            result.finish_reason = stats.finish_reason = "length"
            stats.total_s = time.perf_counter() - started
            self.stats.add(stats)
            return
        claim = self.slots.pick(request.prompt, fields["salt"], reuse=request.use_pool)
        body = completion_body(
            model=self.info.model_id,
            dialect=self.info.dialect,
            prompt=request.prompt,
            max_tokens=1 if forced else request.sampling.max_new_tokens,
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            top_k=fields["top_k"],
            min_p=fields["min_p"],
            seed=request.sampling.seed,
            stop=request.stop,
            cache_prompt=request.use_pool if claim is None else claim.reuse,
            slot=None if claim is None else claim.slot,
            prompt_logprobs=bool(request.observe.logprobs) and self.signals_source == "server",
            extra=fields["extra"],
        )
        last = CompletionEvent()
        text: list[str] = []
        got_ids = False
        logprobs_whole = True  # result.token_logprobs has one value per id so far
        first_at = None
        last_at = 0.0
        closed_at = 0.0  # when the caller closed the stream early, before the scorer's work
        events = self.client.stream("/v1/completions", body, cancelled=result.cancelled)
        try:
            for raw in events:
                event = parse_event(raw)
                text.append(event.text)
                if event.prompt_logprobs is not None:
                    result.prompt_logprobs = [None, *event.prompt_logprobs[1:]]
                if event.finish_reason:
                    last.finish_reason = event.finish_reason
                if event.cached_tokens is not None:
                    last.cached_tokens = event.cached_tokens
                if event.token_ids and first_at is None:
                    first_at = time.perf_counter()
                    stats.ttft_s = first_at - started
                if forced or not event.token_ids:
                    continue
                got_ids = True
                ids = event.token_ids
                missing = (event.generated_so_far or 0) - len(result.token_ids) - len(ids)
                if missing > 0:  # llama.cpp withheld the tokens that ended inside a character
                    ids = self._with_withheld(event.text, ids, missing)
                    logprobs_whole = False  # the withheld tokens' are unknown: none from here on
                if logprobs_whole and len(event.token_logprobs) == len(ids):
                    result.token_logprobs.extend(event.token_logprobs)
                last_at = time.perf_counter()
                for token in ids:
                    result.token_ids.append(token)
                    stats.generated_tokens = len(result.token_ids)
                    yield token
            if last.finish_reason is None:
                raise RemoteEngineError(
                    f"the engine at {self.url} ended the reply without a finish reason",
                    hint="the turn was undone and no message was lost; retry once the server is back",
                )
            if forced:
                result.token_ids.extend(forced)
                stats.forced_tokens = len(forced)
                yield from forced
            elif not got_ids and "".join(text):
                # A server that names no token ids: the reply re-tokenized (a prefix may
                # then differ from what the server cached; it is said in the log once).
                _warn_once(
                    self, "retokenized", "the engine at %s returns no token ids: replies are re-tokenized locally"
                )
                for token in self.tokenizer.encode("".join(text), add_special_tokens=False):
                    result.token_ids.append(int(token))
                    yield int(token)
            if first_at is None:
                stats.ttft_s = time.perf_counter() - started
            result.finish_reason = _finish_reason(last.finish_reason)
            if got_ids:  # from the reply's first token to its last (one token: 0)
                stats.decode_s = last_at - (first_at or last_at)
            elif not forced:  # no ids to time: the whole call
                stats.decode_s = time.perf_counter() - started
            # after the reply, so the scorer's prefill never delays the first token
            self._observe_locally(request, result)
        except GeneratorExit:
            # the caller ended the reply (its token cap, a repeat): the prompt's signals
            # still come, unless the caller undoes the turn (Generation.abandon); the
            # scorer's time is observe_s, not decoding
            events.close()
            closed_at = time.perf_counter()
            if not result.abandoned:
                self._observe_locally(request, result)
            raise
        finally:
            events.close()
            if first_at is not None and not stats.decode_s:  # a stream its caller closed early
                stats.decode_s = (closed_at or time.perf_counter()) - first_at
            generated = [] if forced else result.token_ids
            self.slots.record(claim, request.prompt + generated)
            stats.cached_tokens = min(len(request.prompt), last.cached_tokens or 0)
            stats.prefill_tokens = len(request.prompt) - stats.cached_tokens
            stats.generated_tokens = len(result.token_ids) if not forced else 0
            stats.finish_reason = result.finish_reason
            stats.total_s = time.perf_counter() - started
            self.stats.add(stats)

    def _with_withheld(self, text: str, named: list[int], missing: int) -> list[int]:
        """An event's ids with the ``missing`` ones the server left out put back
        (``token_bytes.py``); where the bytes cannot say which, the event's text
        re-tokenized: the text is right, the ids may differ from what the server holds."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        withheld = self._token_bytes.withheld(text, named, missing)
        if withheld is not None:
            return [*withheld, *named]
        _warn_once(self, "withheld", "the engine at %s withheld token ids the vocabulary cannot recover: re-tokenized")
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]


def _generation_prompt_length(tokenizer: Any) -> int:
    """How many ids the chat template adds to open the assistant's reply; 0 for a
    template the chat format cannot read (slots are then matched on whole prompts)."""
    try:
        return len(ChatFormat.from_tokenizer(tokenizer).generation_prompt_ids)
    except ValueError:  # ChatTemplateError included
        return 0


def _finish_reason(server: str | None) -> str:
    return "stop" if server == "stop" else "length"


def _warn_once(engine: RemoteEngine, what: str, message: str) -> None:
    """Log ``message`` (with the engine's URL) the first time ``what`` happens."""
    if not engine.memo.get(f"warned_{what}"):
        engine.memo[f"warned_{what}"] = True
        log.warning(message, engine.url)


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({int(eos)})


__all__ = ["RemoteEngine", "RemoteEngineError", "parse_engine_url"]
