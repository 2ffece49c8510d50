"""One ``/v1/completions`` request body, and what its streamed events say.

Pure functions, no I/O: what each server dialect needs (see ``server_info.py``) is
written here once, so the engine only sends and reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.engine.penalties import CountPenalty, LogitBias, NoRepeatNgram, RepetitionPenalty
from clm_middleware.errors import ConfigError
from clm_middleware.structured.server_side import ServerFormat


@dataclass(slots=True)
class CompletionEvent:
    """What one streamed event carries; absent facts are None / empty."""

    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_so_far: int | None = None  # llama.cpp: tokens generated up to this event (timings.predicted_n)
    prompt_logprobs: list[float | None] | None = None


def penalty_fields(processors: Sequence[Any], dialect: str) -> dict[str, Any]:
    """The server's own sampling controls for our penalty processors (engine/penalties.py),
    ``logit_bias`` (llama.cpp reads ``[[id, bias], ...]``; vLLM and others OpenAI's
    ``{"id": bias}``) and a response format (``ServerFormat``: the server's grammar).

    Any other processor (a JSON grammar, a caller's function) needs the logits, which a
    remote engine never sees: a ``ConfigError`` rather than a silently unshaped reply.
    """
    fields: dict[str, Any] = {}
    for processor in processors:
        if isinstance(processor, RepetitionPenalty):
            fields["repeat_penalty" if dialect == "llamacpp" else "repetition_penalty"] = processor.penalty
        elif isinstance(processor, CountPenalty):
            fields["frequency_penalty"] = processor.frequency
            fields["presence_penalty"] = processor.presence
        elif isinstance(processor, LogitBias):
            if dialect == "llamacpp":
                fields["logit_bias"] = [[token, bias] for token, bias in processor.bias]
            else:
                fields["logit_bias"] = {str(token): bias for token, bias in processor.bias}
        elif isinstance(processor, ServerFormat):
            fields.update(processor.request_fields(dialect))
        elif isinstance(processor, NoRepeatNgram):
            raise ConfigError("no_repeat_ngram_size", "a remote engine has no n-gram ban; use repetition_penalty")
        else:
            raise ConfigError(
                "logits_processors",
                f"{type(processor).__name__} needs the logits, which a remote engine does not expose",
                hint="structured output and custom processors need the local engine",
            )
    return fields


def completion_body(
    *,
    model: str,
    dialect: str,
    prompt: list[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    stop: Sequence[str],
    cache_prompt: bool,
    slot: int | None,
    prompt_logprobs: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,  # token ids: the server reads exactly what we rendered
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": True,
        # usage on every event, not only the last: a consumer that stops early (a
        # repetition cut, max_new_tokens reached) still has the server's cache count
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **extra,
    }
    if stop:
        body["stop"] = list(stop)
    if seed is not None:
        body["seed"] = seed
    if top_k is not None:
        body["top_k"] = top_k
    if min_p is not None:
        body["min_p"] = min_p
    if dialect == "llamacpp":
        body["cache_prompt"] = cache_prompt
        body["n_probs"] = 1  # each event then names its token: logprobs.content[].id
        body["timings_per_token"] = True  # timings.cache_n on every event (see stream_options)
        if slot is not None:
            body["id_slot"] = slot
    else:
        body["logprobs"] = 1
        body["return_token_ids"] = True  # vLLM ≥ 0.10.2: choices[].token_ids
        if prompt_logprobs:
            body["prompt_logprobs"] = 0  # vLLM: the log p of each prompt token itself
    return body


def parse_event(event: dict[str, Any]) -> CompletionEvent:
    parsed = CompletionEvent()
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        parsed.text = choice.get("text") or ""
        parsed.finish_reason = choice.get("finish_reason")
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs") or {}
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if content:  # llama.cpp: [{id, token, logprob, top_logprobs}, ...]
            parsed.token_ids = [int(item["id"]) for item in content]
            parsed.token_logprobs = [float(item["logprob"]) for item in content if "logprob" in item]
        elif ids:  # vLLM
            parsed.token_ids = [int(t) for t in ids]
            values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
            if values and len(values) == len(ids):
                parsed.token_logprobs = [float(v) for v in values]
        prompt_values = choice.get("prompt_logprobs")
        if prompt_values is not None:
            parsed.prompt_logprobs = [_own_logprob(entry) for entry in prompt_values]
    usage = event.get("usage") or {}
    if usage:
        parsed.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            parsed.cached_tokens = int(details["cached_tokens"])
    timings = event.get("timings") or {}
    if timings.get("predicted_n") is not None:
        parsed.generated_so_far = int(timings["predicted_n"])
    if parsed.cached_tokens is None and timings.get("cache_n") is not None:
        parsed.cached_tokens = int(timings["cache_n"])
    if parsed.cached_tokens is None and event.get("tokens_cached") is not None:
        parsed.cached_tokens = int(event["tokens_cached"])
    return parsed


def _own_logprob(entry: Any) -> float | None:
    """vLLM's ``prompt_logprobs[i]``: None at position 0, else ``{token_id: {logprob, rank, ...}}``
    holding the prompt's own token (``prompt_logprobs=0`` asks for it alone)."""
    if not entry:
        return None
    first = next(iter(entry.values()))
    return float(first["logprob"]) if isinstance(first, dict) else float(first)
