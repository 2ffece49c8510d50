"""LangChain messages → (role, text) turns, and the hashes that recognise a known history.

A history is recognised by the hashes of its messages, computed from what the model
sees of them (role, text, tool calls, tool call id, name) and never from ids or
metadata that callers may add on the way back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from clm_middleware.errors import ConfigError
from clm_middleware.render.content import join_text_parts
from clm_middleware.render.tool_calls import render_tool_calls


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # system | user | assistant | tool
    text: str
    digest: str


def message_text(message: BaseMessage) -> str:
    """The text of a message's content: text blocks joined; blocks with data a tool
    returns (``json``, ``search_result``, a text ``document``, ``custom_tool_call_output``,
    a dict without a type) as their text; media named, not dropped silently; reasoning
    left out (a template shows a model its earlier answers, not its earlier thoughts)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = [text for block in content if (text := _block_text(block)) is not None]
    return join_text_parts(parts)


def _block_text(block: Any) -> str | None:
    """What the model reads of one content block; None for a block it is not shown."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return _as_json(block)
    kind = block.get("type")
    if kind in ("text", "text-plain"):
        return str(block.get("text", ""))
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
        return join_text_parts(p for p in (block.get("title"), str(block["source"].get("data", ""))) if p)
    if kind is None:
        return _as_json(block)  # a tool's plain dict, e.g. [{"temp": 21}]
    return f"[{kind} omitted]"  # image, audio, video, file, a binary document


def _search_result_text(block: dict[str, Any]) -> str:
    """A search result as its title, source and text (Anthropic's and LangChain's shape:
    ``content`` a list of text blocks)."""
    body = block.get("content")
    texts = [body] if isinstance(body, str) else [t for item in body or () if (t := _block_text(item)) is not None]
    head = [str(block[key]) for key in ("title", "source") if block.get(key)]
    return join_text_parts([*head, *texts])


def _as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


# ChatMessage's free-form role, as OpenAI and LangChain spell the roles a chat template knows
CHAT_MESSAGE_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "tool": "tool",
}


def to_turn(message: BaseMessage) -> Turn:
    if isinstance(message, ChatMessage):
        role = CHAT_MESSAGE_ROLES.get(str(message.role).strip().lower())
        if role is None:
            raise ConfigError(
                "messages",
                f"ChatMessage role {message.role!r} is not one a chat template knows",
                hint=f"use one of {', '.join(CHAT_MESSAGE_ROLES)}",
            )
        text = message_text(message)
    elif isinstance(message, SystemMessage):
        role, text = "system", message_text(message)
    elif isinstance(message, HumanMessage):
        role, text = "user", message_text(message)
    elif isinstance(message, AIMessage):
        role = "assistant"
        calls = [{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
        text = assistant_text(message_text(message), calls)
    elif isinstance(message, ToolMessage):
        role = "tool"
        text = message_text(message)
        if getattr(message, "status", "success") == "error" and not text.lstrip().lower().startswith("error"):
            text = f"Error: {text}"  # LangGraph's ToolNode already writes "Error: ..."
    else:
        raise ConfigError(
            "messages",
            f"unsupported message type {type(message).__name__}",
            hint="use SystemMessage, HumanMessage, AIMessage, ToolMessage or ChatMessage",
        )
    return Turn(role, text, turn_digest(role, text))


def turn_digest(role: str, text: str) -> str:
    """The identity of a message as the model sees it (its role and text); the same for
    every client (LangChain, HTTP).

    Nothing the model is never shown is part of it, since clients change such fields
    when they send a history back: a message's ``name`` (LangGraph agents and AutoGen set
    it on replies), a tool call's id (some frameworks make new ids each time they
    re-send a history). Counting them would fork the conversation on every call."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps([role, text], ensure_ascii=False).encode())
    return digest.hexdigest()


def assistant_text(content: str, calls: Sequence[dict[str, Any]]) -> str:
    """An assistant message as the model sees it: its text, then its tool calls
    (``{"name", "arguments"}`` each) in the prompt format of ``tools.py``."""
    return "\n".join(part for part in (content, render_tool_calls(calls)) if part)
