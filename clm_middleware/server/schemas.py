"""The request body of ``POST /v1/chat/completions``, as the OpenAI API defines it.

Fields we do not use (``service_tier``, ``user`` beyond tenancy, ...) are accepted and
ignored, as vLLM and llama.cpp's server do, except where ignoring one would return
something other than what was asked: ``n`` above 1, ``logprobs`` and ``top_logprobs``,
and vLLM's ``continue_final_message`` / ``add_generation_prompt: false`` (continue the
last assistant message) are refused by name (see ``convert.py``).

Beyond OpenAI's fields, the sampling filters vLLM and llama.cpp's server take as extra
body fields are honoured under their names there: ``top_k`` (vLLM's ``-1``, like ``0``,
is off) and ``min_p``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# "function": the legacy function-calling API's result message, read as a tool's
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Lenient(BaseModel):
    # lenient about fields it does not know, strict about the types of those it does, as
    # OpenAI's API is: "stream": "yes" or "max_tokens": true is a 400, not a guess (an
    # integer is still a number); NaN and ±Infinity (which Python's JSON reader admits)
    # are not numbers any field takes
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, values: Any) -> Any:
        """OpenAI's API takes ``null`` for an optional field as "not given" (clients send
        ``"n": null``, ``"stream": null``, ``"stream_options": {"include_usage": null}``):
        such a field gets its default, at any depth of the request."""
        if isinstance(values, dict):
            defaults = {name for name, f in cls.model_fields.items() if not f.is_required() and f.default is not None}
            values = {k: v for k, v in values.items() if not (v is None and k in defaults)}
        return values


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part, as OpenAI returns it in history


class ChatMessage(_Lenient):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # the legacy API's call in an assistant message


class FunctionSpec(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # as OpenAI: letters, digits, _ and -
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # the legacy function-calling API: refused by name (convert.py), never ignored
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extra body field, as vLLM / llama.cpp
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extra body field, as vLLM / llama.cpp
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    response_format: ResponseFormat | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None  # token id (as a string) → bias in [-100, 100]
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extra fields for continuing the last assistant message (a chat UI's "Continue"):
    # refused when they ask for it (convert.py), never ignored
    continue_final_message: bool = False
    add_generation_prompt: bool = True
