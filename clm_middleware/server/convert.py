"""OpenAI chat-completions request ↔ a managed chat call (``adapters/chat_call.py``).

Messages become the same ``Turn``s, with the same digests, that ChatCLM makes of LangChain
messages, so a history re-sent over HTTP extends its conversation exactly as ChatCLM's
does: an assistant message is identified by its text plus its tool calls, whatever ids
or fields a client adds on the way back.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from clm_middleware.adapters.chat_call import ChatAnswer, ChatRequest
from clm_middleware.adapters.messages import Turn, assistant_text, turn_digest
from clm_middleware.adapters.tools import check_tools
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.render.chat_format import lone_surrogate
from clm_middleware.render.content import join_text_parts
from clm_middleware.structured import ResponseFormat

from .errors import APIError
from .schemas import ChatCompletionRequest, ChatMessage, ToolCall

MAX_STOPS = 4  # as OpenAI


def chat_request(body: ChatCompletionRequest, defaults: GenerationSettings, session_id: str | None) -> ChatRequest:
    """The call to make; an ``APIError`` (400) naming the field for what cannot be served."""
    refuse_lone_surrogates(body.model_dump(by_alias=True, exclude_none=True))
    if body.n != 1:
        raise APIError(400, "n: only n=1 is supported", param="n")
    if body.stream_options is not None and not body.stream:
        # as OpenAI and vLLM: the options say how to stream, so they need a stream
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
    if body.logprobs:
        raise APIError(400, "logprobs: not supported by this server", param="logprobs")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs: needs logprobs, which this server does not support", param="top_logprobs")
    _refuse_continuation(body)
    bias = _logit_bias(body.logit_bias)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise APIError(
            400, "stop: an empty string would stop before the first token; give non-empty strings", param="stop"
        )
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop: give at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    for legacy, use in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None:  # answering as if it were absent would drop the functions
            message = f"{legacy}: the legacy function-calling API is not supported; send {use} (OpenAI's current form)"
            raise APIError(400, message, param=legacy)
    sent = [spec.model_dump(exclude_none=True) for spec in body.tools or []]
    check_tools(sent)
    tools, tool_choice = _allowed_tools(body.tool_choice, sent)
    _check_tool_choice(tool_choice, tools)
    settings = GenerationSettings(
        max_new_tokens=body.max_completion_tokens or body.max_tokens or defaults.max_new_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else max(body.top_k, 0),  # vLLM's -1 is off
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=tuple(dict.fromkeys([*defaults.stop, *stops])),
        repetition_penalty=defaults.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        no_repeat_ngram_size=defaults.no_repeat_ngram_size,
        logit_bias=bias,
    )
    return ChatRequest(
        turns=[to_turn(message, index) for index, message in enumerate(body.messages)],
        settings=settings,
        tools=tools,
        tool_positions=tuple(sent.index(tool) for tool in tools),  # allowed_tools may narrow them
        tool_choice=tool_choice,
        parallel_tool_calls=bool(body.parallel_tool_calls),
        response_format=_response_format(body),
        session_id=session_id,
        invalid_calls_as_text=True,
    )


def _refuse_continuation(body: ChatCompletionRequest) -> None:
    """vLLM's ``continue_final_message`` (or ``add_generation_prompt: false``) asks that the
    last assistant message be continued; here a history ending with an assistant message
    is a finished turn and the reply a new one, so answering would not be what was asked."""
    for name, asks in (
        ("continue_final_message", body.continue_final_message),
        ("add_generation_prompt", not body.add_generation_prompt),
    ):
        if asks:
            message = (
                f"{name}: continuing the last assistant message is not supported; the reply is always"
                " a new assistant turn (drop the field to get one)"
            )
            raise APIError(400, message, param=name)


def to_turn(message: ChatMessage, index: int) -> Turn:
    """One message as a turn. A history from the legacy function-calling API reads as
    the tools API's: an assistant's ``function_call`` is its call, a ``function``
    message the call's result."""
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    functions = [c.function for c in message.tool_calls or []] + [message.function_call] * bool(message.function_call)
    if message.content is None and (role != "assistant" or not functions):
        # "" is a message (an empty turn); none is not, as OpenAI's API has it: only an
        # assistant message that calls tools may leave its content out
        needs = "content or tool_calls" if role == "assistant" else "one"
        raise _bad_message(index, "content", f"a message of role {message.role!r} needs {needs}")
    text = _content_text(message, index)
    if role == "assistant":
        calls = [{"name": f.name, "arguments": _arguments(f.arguments)} for f in functions]
        text = assistant_text(text, calls)
    elif functions:
        field = "tool_calls" if message.tool_calls else "function_call"
        raise _bad_message(index, field, "only assistant messages carry tool calls")
    if message.role == "tool" and not message.tool_call_id:
        raise _bad_message(index, "tool_call_id", "a tool message needs one")
    return Turn(role, text, turn_digest(role, text))


def refuse_lone_surrogates(value: Any, path: str = "") -> None:
    """An ``APIError`` (400) naming the first field of a parsed request body whose text
    holds a lone surrogate (a broken ``\\ud800`` escape, which JSON admits). No tokenizer,
    hash or JSON response can take one, wherever it sits (content, a name, a session id,
    a tool description), so the request is refused before anything runs."""
    problem = "holds a lone surrogate (e.g. \\ud800): not Unicode text"
    if isinstance(value, str):
        if lone_surrogate(value) is not None:
            raise APIError(400, f"{path}: {problem}", param=path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if lone_surrogate(str(key)) is not None:
                raise APIError(400, f"{path}: a key {problem}", param=path)
            refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            refuse_lone_surrogates(item, f"{path}[{index}]")


def _calls(message: ChatMessage) -> list[ToolCall]:
    return message.tool_calls or []


def _bad_message(index: int, field: str, problem: str) -> APIError:
    param = f"messages[{index}].{field}"
    return APIError(400, f"{param}: {problem}", param=param)


def completion_body(answer: ChatAnswer, model: str, completion_id: str, session_id: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.tool_calls:
        message["tool_calls"] = tool_calls(answer)
    elif message["content"] is None:
        message["content"] = ""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}],
        "usage": usage(answer),
        "clm": extension(answer, session_id),
    }


def chunk(
    completion_id: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None
) -> dict[str, Any]:
    """One streamed chunk; every chunk of a completion carries its id and its ``created``
    (the completion's start, in seconds), as OpenAI's do."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def tool_calls(answer: ChatAnswer) -> list[dict[str, Any]]:
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["args"], ensure_ascii=False)},
        }
        for call in answer.tool_calls
    ]


def usage(answer: ChatAnswer) -> dict[str, Any]:
    prompt, completion, cached = answer.usage()
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def extension(answer: ChatAnswer, session_id: str | None) -> dict[str, Any]:
    """The ``clm`` object: what the lifecycle did this turn (docs/serve.md lists the fields)."""
    stats = answer.reply.stats
    return {
        "conversation_id": answer.conversation.id,
        "session_id": session_id,
        "route": answer.route,
        "turn": answer.reply.turn,
        "tagging_mode": stats.tagging_mode,
        "context_tokens": stats.context_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "ahead_tokens": stats.ahead_tokens,
        "ahead_prefill_tokens": stats.ahead_prefill_tokens,
        "compaction": stats.compaction,
        "dropped_tokens": stats.dropped_tokens,
        "compressed_tokens": stats.compressed_tokens,
        "restored": list(stats.restored),
        "lifecycle_s": stats.lifecycle_s,
        "decision_counts": stats.decisions,
        "decisions": [d.as_dict() for d in answer.reply.decisions],
        "reply_flags": list(stats.reply_flags),
        "invalid_tool_calls": answer.invalid_tool_calls,
        "ttft_s": stats.ttft_s,
        "turn_s": stats.turn_s,
    }


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for position, part in enumerate(content):
        where = f"content[{position}]"
        if part.type == "text":
            if part.text is None:
                raise _bad_message(index, f"{where}.text", "a text part needs its text")
            parts.append(part.text)
        elif part.type == "refusal" and message.role == "assistant":
            if part.refusal is None:
                raise _bad_message(index, f"{where}.refusal", "a refusal part needs its refusal text")
            parts.append(part.refusal)  # what the assistant said, as a text part would hold it
        elif part.type == "refusal":
            raise _bad_message(index, f"{where}.type", "only an assistant message holds a refusal part")
        else:
            raise _bad_message(index, f"{where}.type", f"only text parts are supported, got {part.type!r}")
    return join_text_parts(parts)


def _arguments(text: str) -> Any:
    """A call's arguments as the model wrote them: the JSON a client sends back, parsed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _allowed_tools(choice: Any, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``: the
    tools the model may call this turn, as (those tools, ``mode`` as the tool choice).
    Only they are shown: a tool the model may not call is no tool to it. Any other
    choice comes back as it is."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return tools, choice
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
        message = 'tool_choice.allowed_tools.mode: must be "auto" or "required"'
        raise APIError(400, message, param="tool_choice.allowed_tools.mode")
    by_name = {tool["function"]["name"]: tool for tool in tools}
    names = []
    listed = allowed.get("tools") or []
    if not isinstance(listed, list):
        raise APIError(400, "tool_choice.allowed_tools.tools: must be a list", param="tool_choice.allowed_tools.tools")
    for index, entry in enumerate(listed):
        name = _function_name(entry)
        if not isinstance(name, str) or name not in by_name:
            param = f"tool_choice.allowed_tools.tools[{index}]"
            raise APIError(400, f"{param}: names no tool in tools ({name!r})", param=param)
        names.append(name)
    if not names:
        param = "tool_choice.allowed_tools.tools"
        raise APIError(400, f"{param}: name at least one tool of tools", param=param)
    return [by_name[name] for name in dict.fromkeys(names)], allowed["mode"]


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> None:
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise APIError(400, "tool_choice: needs tools", param="tool_choice")
    if isinstance(choice, dict):
        if choice.get("type", "function") != "function":
            message = f"tool_choice.type: {choice.get('type')!r} is not supported (function or allowed_tools)"
            raise APIError(400, message, param="tool_choice.type")
        name = _function_name(choice)
        if not isinstance(name, str):
            example = '{"type": "function", "function": {"name": "..."}}'
            message = f"tool_choice.function.name: a string is required (e.g. {example})"
            raise APIError(400, message, param="tool_choice.function.name")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")


def _function_name(choice: Any) -> Any:
    """``choice["function"]["name"]`` as the client wrote it (of any type), or None where
    ``choice`` or its ``function`` is no object."""
    function = choice.get("function") if isinstance(choice, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _response_format(body: ChatCompletionRequest) -> ResponseFormat | None:
    """OpenAI's ``response_format``: ``json_object`` or ``json_schema`` (its ``name``,
    ``schema`` and ``strict``; the grammar is always strict). A bad schema is a 400
    naming the field."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        if schema is None:  # the field the message names is the one missing
            missing = "response_format.json_schema" + (".schema" if fmt.json_schema else "")
            raise APIError(400, f"{missing}: required", param=missing)
        name = fmt.json_schema.name if fmt.json_schema else None
        try:
            return ResponseFormat.from_schema(schema, name=name)
        except ConfigError as error:
            raise APIError(400, str(error), param=error.field) from None
    return ResponseFormat.json_object()
