"""ChatCLM's argument checks: an unknown argument or a bad setting fails at construction,
and an argument one call does not use fails that call before its turn.

Other LangChain chat models reject or warn about arguments they do not know; silently
dropping ``num_ctx=`` or ``base_url=`` would let a user believe a setting took effect.
Settings are checked by the same validators the library uses (``ConfigError`` names the
field), and a model path that is not there fails now, not at the first ``invoke``.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Collection, Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from clm_middleware.errors import ConfigError

# what users of other chat models reach for, and what it is called here
LOOKALIKES = {
    "num_ctx": "budget",
    "max_context_tokens": "budget",
    "model_name": "model",
    "max_new_tokens": "max_tokens",
    "num_predict": "max_tokens",
}
# other chat models' names that ChatCLM accepts as they are, for the setting named here
ALIASES = {"repeat_penalty": "repetition_penalty"}  # ChatOllama's, llama.cpp's
REMOTE = ("base_url", "api_base", "openai_api_base", "openai_api_key")


def resolve_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each alias (``ALIASES``) renamed to its setting; ``ConfigError`` when
    both names are given with different values (which one was meant is unknowable)."""
    if not any(alias in values for alias in ALIASES):
        return values
    resolved = dict(values)
    for alias, name in ALIASES.items():
        if alias not in resolved:
            continue
        value = resolved.pop(alias)
        if name in resolved and resolved[name] != value:
            raise ConfigError(alias, f"is another name for {name!r}, which is also given ({resolved[name]!r})")
        resolved[name] = value
    return resolved


# what one call (``invoke(..., temperature=0)``, ``bind(...)``, ``bind_tools``) may set
CALL_ARGUMENTS = frozenset(
    {
        "model",
        "session_id",
        "stop",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "logit_bias",
        "response_format",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "no_repeat_ngram_size",
        # ChatOpenAI's switch for usage on the last streamed chunk (ChatCLM.stream_usage)
        "stream_usage",
        *ALIASES,
    }
)


def unknown_call_arguments(values: dict[str, Any]) -> None:
    """Raise ``ConfigError`` for the first per-call argument ChatCLM does not use: a
    misspelt ``temprature=0`` must not look as if it took effect."""
    unknown_arguments(values, CALL_ARGUMENTS, what="a call of ChatCLM takes no such argument")


def unknown_arguments(
    values: dict[str, Any], known: Collection[str], what: str = "ChatCLM has no such argument"
) -> None:
    """Raise ``ConfigError`` for the first argument ChatCLM does not have, with a hint."""
    for name in values:
        if name in known:
            continue
        if name in REMOTE:
            hint = "ChatCLM runs the model in this process; to reach a server, run `clm serve` and use ChatOpenAI"
        elif name in LOOKALIKES:
            hint = f"ChatCLM calls it {LOOKALIKES[name]!r}"
        else:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
        raise ConfigError(name, what, hint=hint)


def chat_settings(**fields: Any) -> Any:
    """``GenerationSettings(**fields)``, with an error naming the setting as ChatCLM spells
    it (``max_tokens``, not the library's ``max_new_tokens``)."""
    from clm_middleware.lifecycle.config import GenerationSettings

    try:
        return GenerationSettings(**fields)
    except ConfigError as error:
        if error.field != "max_new_tokens":
            raise
        raise ConfigError("max_tokens", error.problem, hint=error.hint) from None


def check_settings(model: Any) -> None:
    """Validate a constructed ChatCLM's settings with the library's own validators."""
    from clm_middleware.lifecycle.config import LifecycleConfig
    from clm_middleware.lifecycle.tagging import TaggingConfig

    LifecycleConfig(
        tagging=TaggingConfig(mode=model.tagging),
        budget=model.budget,
        k=model.k,
        compression=model.compression,
        compact_ahead=model.compact_ahead,
    )
    chat_settings(
        max_new_tokens=model.max_tokens,
        temperature=model.temperature,
        top_p=model.top_p,
        top_k=model.top_k,
        min_p=model.min_p,
        repetition_penalty=model.repetition_penalty,
        frequency_penalty=model.frequency_penalty,
        presence_penalty=model.presence_penalty,
        no_repeat_ngram_size=model.no_repeat_ngram_size,
        seed=model.seed,
    )
    if model.engine_url:
        from clm_middleware.engine_settings import LOCAL_ENGINE_SETTINGS, refuse_local_settings

        refuse_local_settings(**{name: getattr(model, name) for name in LOCAL_ENGINE_SETTINGS})
    if model.engine is None and not model.engine_url:
        _check_local_engine_settings(model)
    if model.engine is None:
        from clm_middleware.cli.setup import TINY_MODEL
        from clm_middleware.models.loading import resolve_model_source

        for name in ("model", "summarizer"):
            value = getattr(model, name)
            if value is not None and value != TINY_MODEL:
                resolve_model_source(value)  # ModelNotFoundError names the path


def _check_local_engine_settings(model: Any) -> None:
    """The engine's settings, checked as the engine will check them when the first call
    builds it: a bad ``kv_dtype`` or ``device`` is refused at construction, not after
    the model has loaded."""
    from clm_middleware.cache.layout import PoolConfig
    from clm_middleware.engine.blend import BlendConfig
    from clm_middleware.engine_settings import refuse_paged_approximate_reuse
    from clm_middleware.errors import ConfigError
    from clm_middleware.models.loading import parse_device, parse_dtype

    PoolConfig(block_size=model.block_size, max_kv_bytes=model.max_kv_bytes, kv_dtype=model.kv_dtype)
    parse_dtype(model.dtype)
    parse_device(model.device)
    if model.approximate_reuse is not None:
        try:
            BlendConfig(recompute_share=model.approximate_reuse)
        except ConfigError as error:
            raise ConfigError("approximate_reuse", error.problem) from None
    refuse_paged_approximate_reuse(model.paged_kv, model.approximate_reuse is not None)


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as given: one string is one stop string (OpenAI's API takes either),
    never its characters; anything else is a ``ConfigError`` naming ``stop``."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, Sequence):  # each string is checked where settings are (GenerationSettings)
        raise ConfigError("stop", f"must be a string or a list of strings, got {stop!r}")
    return list(stop)


def call_setting(model: Any, kwargs: dict[str, Any], name: str) -> Any:
    """A per-call setting (``invoke(..., temperature=0.2)``) validated as the constructor
    validates ``model``'s field of that name (``"0.1"`` reads as 0.1; ``max_tokens=2.7``
    is refused, never cut to 2), else the model's own value. A bool where a number belongs
    or a value the field refuses is a ``ConfigError`` naming it."""
    if name not in kwargs:
        return getattr(model, name)
    value = kwargs[name]
    if isinstance(value, bool):
        raise ConfigError(name, f"must be a number, got {value!r}")
    try:
        return _field_adapter(type(model), name).validate_python(value)
    except ValidationError as error:
        raise ConfigError(name, f"{_problem(error.errors()[0])}, got {value!r}") from None


@functools.cache
def _field_adapter(model_class: type, name: str) -> TypeAdapter:
    return TypeAdapter(model_class.model_fields[name].annotation)


def config_error(error: ValidationError) -> ConfigError:
    """The ``ConfigError`` a constructor's ``ValidationError`` stands for: the library's own,
    raised by a validator, or one naming the field pydantic refused."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        return cause
    where = ".".join(str(part) for part in first["loc"]) or "ChatCLM"
    return ConfigError(where, f"{_problem(first)}, got {first.get('input')!r}")


def _problem(detail: Any) -> str:
    """One of pydantic's error details as a clause: "input should be a valid integer, ..."."""
    message = detail["msg"]
    return message[:1].lower() + message[1:]
