"""Build engines and per-mode drivers for CLI commands from their common options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from clm_middleware.cache import PoolConfig
from clm_middleware.engine import Engine
from clm_middleware.engine.protocol import ServingEngine, signals_source
from clm_middleware.engine_settings import refuse_local_settings
from clm_middleware.errors import ConfigError
from clm_middleware.models.quantization import model_quantization
from clm_middleware.render import ChatFormat
from clm_middleware.replay.plain import PlainChatDriver
from clm_middleware.replay.runner import ReplayOptions, TurnDriver
from clm_middleware.replay.transcript import Transcript

T = TypeVar("T")
_REGISTER_TRIES = 32  # processes replaying into one store at once, each taking a free id
TINY_MODEL = "tiny"  # the random test model: exercises every path in milliseconds


def build_engine(
    model: str | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    block_size: int = 16,
    max_kv_bytes: int | None = None,
    max_blocks: int | None = None,
    kv_dtype: str | None = None,
    approximate_reuse: float | None = None,
    paged_kv: bool = False,
    quantization: str | None = None,
    compile_decode: bool = False,
    disk_cache_dir: str | None = None,
    min_free_disk_mb: int = 512,
    engine_url: str | None = None,
    engine_model: str | None = None,
    engine_api_key: str | None = None,
    engine_signals: str = "auto",
    engine_scorer: str | None = None,
) -> ServingEngine:
    """The local engine for ``model``; with ``engine_url``, a ``RemoteEngine`` on that server,
    with ``model``'s tokenizer and, for signals, ``engine_scorer`` as a local scorer."""
    if engine_url is not None:
        refuse_local_settings(
            approximate_reuse=approximate_reuse,
            paged_kv=paged_kv,
            quantization=quantization,
            compile_decode=compile_decode,
        )
        return build_remote_engine(
            engine_url,
            model,
            engine_model=engine_model,
            api_key=engine_api_key,
            signals=engine_signals,
            scorer=engine_scorer,
            dtype=dtype,
        )
    pool_config = PoolConfig(block_size=block_size, max_kv_bytes=max_kv_bytes, max_blocks=max_blocks, kv_dtype=kv_dtype)
    extra: dict[str, Any] = {
        "disk_cache_dir": disk_cache_dir,
        "min_free_disk_mb": min_free_disk_mb,
        "paged_kv": paged_kv,
        "compile_decode": compile_decode,
    }
    if approximate_reuse is not None:
        from clm_middleware.engine.blend import BlendConfig

        extra["blend"] = BlendConfig(recompute_share=approximate_reuse)
    if model == TINY_MODEL:
        from clm_middleware.models import tiny_llama, tiny_tokenizer
        from clm_middleware.models.quantization import quantize_model

        tiny = tiny_llama()
        if quantization is not None:
            quantize_model(tiny, quantization)
        return Engine(tiny, tiny_tokenizer(), pool_config=pool_config, **extra)
    from clm_middleware.models.loading import load_model, load_tokenizer

    loaded = load_model(model, device=device, dtype=dtype, quantization=quantization)
    return Engine(loaded, load_tokenizer(model), pool_config=pool_config, **extra)


def build_remote_engine(
    url: str,
    model: str | None,
    *,
    engine_model: str | None = None,
    api_key: str | None = None,
    signals: str = "auto",
    scorer: str | None = None,
    dtype: str = "float32",
) -> ServingEngine:
    """A ``RemoteEngine`` with ``model``'s tokenizer. Its signals scorer (when signals come
    from one) is ``scorer``; by default the default model (SmolLM2-135M, small enough for
    a CPU beside any server), or the tiny model when ``model`` is the tiny one. A scorer
    that tokenizes as ``model`` scores position by position, another is aligned by characters."""
    from clm_middleware.remote import RemoteEngine

    if model == TINY_MODEL:
        from clm_middleware.models import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    else:
        from clm_middleware.models.loading import load_tokenizer

        tokenizer = load_tokenizer(model)
    remote = RemoteEngine(url, tokenizer, model=engine_model, api_key=api_key, signals=signals)
    if remote.wants_scorer:  # the server gives no self-information: a small local model does (on CPU)
        remote.use_scorer(build_engine(scorer or default_scorer(model), dtype=dtype))
    return remote


def default_scorer(model: str | None) -> str | None:
    """The scorer for a served ``model`` when none is named: the tiny model scores for the
    tiny model (tests); anything else gets the default model (None)."""
    return TINY_MODEL if model == TINY_MODEL else None


def sibling_engine(engine: ServingEngine) -> ServingEngine:
    """Same weights and tokenizer, its own pool (and no disk tier): modes under comparison never share blocks.
    A remote engine is its own sibling: the server's cache is shared whatever we do."""
    if not isinstance(engine, Engine):
        return engine
    return Engine(
        engine.model,
        engine.tokenizer,
        pool_config=engine.pool.config,
        blend=engine.blend,
        paged_kv=engine.paged_kv,
        compile_decode=engine.decoder is not None,  # loads the library the engine compiled
        compile_cache_dir=engine.decoder.cache_dir if engine.decoder is not None else None,
    )


def engine_description(engine: ServingEngine) -> dict[str, Any]:
    """Report settings that say which engine ran: a remote engine's server, kind and
    ``signals_source``; for the local engine, ``signals_source: local``, the model's and
    the pool's dtypes, the pool's size in blocks, and each opt-in that is on."""
    describe = getattr(engine, "describe", None)
    if callable(describe):
        return describe()
    blend = getattr(engine, "blend", None)
    approximate = {"approximate_reuse": blend.recompute_share} if blend is not None else {}
    paged = {"paged_kv": True} if getattr(engine, "paged_kv", False) else {}
    model = getattr(engine, "model", None)
    quantized = {"quantization": model_quantization(model)} if model is not None and model_quantization(model) else {}
    compiled = {"compile_decode": True} if getattr(engine, "decoder", None) is not None else {}
    storage = {}
    if model is not None and getattr(engine, "pool", None) is not None:  # what rounds the numbers, and how much fits
        storage = {
            "dtype": str(model.dtype).removeprefix("torch."),
            "kv_dtype": str(engine.pool.kv_dtype).removeprefix("torch."),
            "pool_blocks": engine.pool.num_blocks,
        }
    return {"signals_source": signals_source(engine), **storage, **approximate, **paged, **quantized, **compiled}


@dataclass(slots=True)
class LifecycleOptions:
    """Settings of the ``clm`` mode, as the CLI names them."""

    budget: int | None = None
    k: int = 2
    tagging: str = "auto"
    compression: str = "auto"
    compact_ahead: bool = False
    db: str | None = None
    tenant: str | None = None
    summarizer: ServingEngine | None = None
    drivers: list[Any] = field(default_factory=list)  # every driver created, in order

    @property
    def conversations(self) -> list[Any]:
        return [d.conversation for d in self.drivers if hasattr(d, "conversation")]

    def settings(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "k": self.k,
            "tagging": self.tagging,
            "compression": self.compression,
            "compact_ahead": self.compact_ahead,
            "db": self.db,
            "tenant": self.tenant,
        }


def driver_factory(
    engine: ServingEngine, options: ReplayOptions, lifecycle: LifecycleOptions | None = None
) -> Callable[[Transcript], TurnDriver]:
    """A factory of drivers for ``options.mode``; every driver made is kept in ``lifecycle.drivers``."""
    lifecycle = lifecycle if lifecycle is not None else LifecycleOptions()
    make = _mode_factory(engine, options, lifecycle)

    def tracked(transcript: Transcript) -> TurnDriver:
        driver = make(transcript)
        lifecycle.drivers.append(driver)
        return driver

    return tracked


def _mode_factory(
    engine: ServingEngine, options: ReplayOptions, lifecycle: LifecycleOptions
) -> Callable[[Transcript], TurnDriver]:
    chat_format = ChatFormat.from_tokenizer(engine.tokenizer)
    if options.mode in ("stateless", "prefix"):
        return lambda transcript: PlainChatDriver(
            engine, chat_format, options, transcript.conversation_id, tools_section(engine, transcript)
        )
    if options.mode == "truncate":
        from clm_middleware.replay.truncate import TruncationDriver

        if lifecycle.budget is None:
            raise ConfigError("budget", "the truncate mode needs --budget")
        return lambda transcript: TruncationDriver(
            engine,
            chat_format,
            options,
            transcript.conversation_id,
            lifecycle.budget,
            tools_section(engine, transcript),
        )
    from clm_middleware.conversation import Conversation
    from clm_middleware.replay.clm_driver import ClmDriver
    from clm_middleware.store import Store

    store = Store(lifecycle.db) if lifecycle.db else None

    def make(transcript: Transcript) -> TurnDriver:
        conversation = _registered(
            store,
            transcript.conversation_id,
            lambda conversation_id: Conversation(
                engine,
                tagging=lifecycle.tagging,
                budget=lifecycle.budget,
                k=lifecycle.k,
                compression=lifecycle.compression,
                compact_ahead=lifecycle.compact_ahead,
                # teacher-forced, a turn with no transcript reply computes one token, as in every mode
                max_new_tokens=options.tokens_to_generate,
                **options.sampling,
                repetition_penalty=options.repetition_penalty,
                frequency_penalty=options.frequency_penalty,
                presence_penalty=options.presence_penalty,
                no_repeat_ngram_size=options.no_repeat_ngram_size,
                summarizer=lifecycle.summarizer,
                store=store,
                conversation_id=conversation_id,
                cache_salt=lifecycle.tenant,
            ),
        )
        conversation.set_tools_prompt(tools_section(engine, transcript))
        return ClmDriver(conversation)

    return make


def tools_section(engine: ServingEngine, transcript: Transcript) -> str | None:
    """The system message's tools section for the tools the transcript declares, as
    ``ChatCLM`` and ``clm serve`` show bound tools (the template's own section where it
    has one); ``None`` when it declares none."""
    if not transcript.tools:
        return None
    from clm_middleware.adapters.chat_call import system_sections  # LangChain loads only here

    return system_sections(engine, list(transcript.tools), None)


def _registered(store: Any, wanted: str, create: Callable[[str], T]) -> T:
    """``create(conversation_id)`` under the transcript's id or the first free suffixed
    one (``_unique_id``); another process on the same store may register that id between
    the look and the write, and the next free one is taken then (bounded tries)."""
    from clm_middleware.store import ConversationExistsError

    for _ in range(_REGISTER_TRIES - 1):
        try:
            return create(_unique_id(store, wanted))
        except ConversationExistsError:
            continue
    return create(_unique_id(store, wanted))


def _unique_id(store: Any, wanted: str) -> str:
    """The transcript's id, suffixed ``#2``, ``#3``... if the store already holds it."""
    if store is None:
        return wanted
    existing = set(store.conversation_ids())
    candidate, number = wanted, 1
    while candidate in existing:
        number += 1
        candidate = f"{wanted}#{number}"
    return candidate


def final_context_fields(lifecycle: LifecycleOptions) -> dict[str, Any]:
    """``final_context``: what the model sees after the last turn (of the last conversation)."""
    drivers = lifecycle.drivers
    if not drivers:
        return {}
    fields: dict[str, Any] = {"final_context": drivers[-1].context}
    if len(drivers) > 1:
        fields["final_contexts"] = {d.conversation_id: d.context for d in drivers}
    return fields
