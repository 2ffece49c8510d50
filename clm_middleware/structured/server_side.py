"""A response format the serving engine enforces.

A remote engine samples on the server, so a grammar can only run there: the turn hands
the engine a ``ServerFormat`` among its logits processors, and the request maps it to
the server's own field (``remote.completion.penalty_fields``): llama.cpp's
``json_schema``, vLLM's ``structured_outputs``, OpenAI's ``response_format`` spelling
elsewhere (SGLang). Only a plain document passes: a tool call between tags, or a choice
between a document and tool calls, is a grammar that no JSON schema states
(``ConfigError`` at construction). A local engine never gets one: called as a logits
processor it raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clm_middleware.errors import ConfigError
from clm_middleware.structured.format import ResponseFormat


@dataclass(frozen=True, slots=True)
class ServerFormat:
    format: ResponseFormat

    def __post_init__(self) -> None:
        if self.format.tags is not None or self.format.calls:
            raise ConfigError(
                "response_format",
                "a tool call's grammar (its tags, or tool calls beside a document) needs the logits, "
                "which a remote engine does not expose",
                hint="ask for a plain JSON document, or serve the model with the local engine",
            )

    def json_schema(self) -> dict[str, Any]:
        """The document's JSON schema; any JSON object is ``{"type": "object"}``."""
        schema = self.format.schema
        return {"type": "object"} if schema is None else schema

    def request_fields(self, dialect: str) -> dict[str, Any]:
        """The request field that asks the server for this format (see the module docstring)."""
        if dialect == "llamacpp":
            return {"json_schema": self.json_schema()}
        if dialect == "vllm":
            return {"structured_outputs": {"json": self.json_schema()}}
        return {"response_format": self.format.as_openai()}

    def __call__(self, token_ids: Any, logits: Any) -> Any:
        raise ConfigError(
            "logits_processors", "a server-side response format runs on the serving engine, not on local logits"
        )
