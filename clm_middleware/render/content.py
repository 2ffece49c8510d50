"""A message given as content parts becomes one text: its text parts, one per line.

OpenAI's API (and LangChain's content blocks) let a message be a list of parts;
``["Translate to Spanish:", "Good morning"]`` must not reach the model as
``Translate to Spanish:Good morning``. Parts are joined with a newline, as vLLM's
OpenAI server joins them, in every entry point (``clm serve``, ``ChatCLM``, replays).

``blocks_text`` reads LangChain / Anthropic content blocks (dicts) the same way for
``ChatCLM`` and for replayed LangChain dumps: what a tool returns as data is its text,
media are named, never dropped silently, and tool calls and reasoning are not shown
(calls are rendered from the message's ``tool_calls``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

TEXT_PART_SEPARATOR = "\n"


def join_text_parts(parts: Iterable[str]) -> str:
    return TEXT_PART_SEPARATOR.join(parts)


def blocks_text(blocks: Iterable[Any]) -> str:
    """The text of a list of content blocks: text blocks joined (``text``, the Responses
    API's ``input_text`` / ``output_text``, a ``refusal``); blocks with data a tool
    returns (``json``, ``search_result``, a text ``document``, ``custom_tool_call_output``,
    Anthropic's ``tool_result``, a dict without a type) as their text; media named, not dropped silently; reasoning
    left out (a template shows a model its earlier answers, not its earlier thoughts)."""
    return join_text_parts(text for block in blocks if (text := block_text(block)) is not None)


def block_text(block: Any) -> str | None:
    """What the model reads of one content block; None for a block it is not shown."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return _as_json(block)
    kind = block.get("type")
    if kind in ("text", "text-plain", "input_text", "output_text"):  # the last two: OpenAI's Responses API
        return str(block.get("text", ""))
    if kind == "refusal":  # what the assistant said, as every entry point reads it
        return str(block.get("refusal", ""))
    if kind == "tool_result":  # Anthropic's: its content a string or blocks
        return _body_text(block.get("content"))
    if kind == "non_standard":  # LangChain's wrapper of a provider's own block
        value = block.get("value")
        return block_text(value) if isinstance(value, dict) and "type" in value else _as_json(value)
    if kind in ("tool_use", "tool_call", "tool_call_chunk", "server_tool_call", "reasoning", "thinking"):
        return None  # tool calls are rendered from ``tool_calls``; thoughts are not shown
    if kind == "json":
        return _as_json(block.get("json"))
    if kind == "search_result":
        return _search_result_text(block)
    if kind == "custom_tool_call_output":
        output = block.get("output")
        return output if isinstance(output, str) else _as_json(output)
    if kind == "document" and isinstance(block.get("source"), dict) and block["source"].get("type") == "text":
        title, data = block.get("title"), _body_text(block["source"].get("data"))
        return join_text_parts(str(p) for p in (title, data) if p)
    if kind is None:
        return _as_json(block)  # a tool's plain dict, e.g. [{"temp": 21}]
    return f"[{kind} omitted]"  # image, audio, video, file, a binary document


def _search_result_text(block: dict[str, Any]) -> str:
    """A search result as its title, source and text (Anthropic's and LangChain's shape:
    ``content`` a list of text blocks)."""
    head = [str(block[key]) for key in ("title", "source") if block.get(key)]
    body = _body_text(block.get("content"))
    return join_text_parts([*head, body] if body else head)


def _body_text(body: Any) -> str:
    """A block's ``content``: a string as it is, a list as content blocks, anything else
    (a number, an object a tool returned) as its JSON; nothing for none."""
    if body is None or isinstance(body, str):
        return body or ""
    return blocks_text(body) if isinstance(body, list) else _as_json(body)


def _as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)
