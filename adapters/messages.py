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
from clm_middleware.render.chat_format import ROLE_SPELLINGS, canonical_role, lone_surrogate
from clm_middleware.render.content import blocks_text
from clm_middleware.render.tool_calls import render_tool_calls


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # system | user | assistant | tool
    text: str
    digest: str


def message_text(message: BaseMessage) -> str:
    """The text of a message's content (``render/content.py``: text blocks joined, tool
    data as its text, media named, reasoning left out)."""
    content = message.content
    if isinstance(content, str):
        return content
    return blocks_text(content)


def to_turn(message: BaseMessage, index: int = 0) -> Turn:
    """The turn a LangChain message is; ``index``, its place in the call's messages, names it in errors."""
    if isinstance(message, ChatMessage):
        role = canonical_role(message.role)
        if role is None:
            raise ConfigError(
                "messages",
                f"ChatMessage role {message.role!r} is not one a chat template knows",
                hint=f"use one of {', '.join(ROLE_SPELLINGS)}",
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
    if (bad := lone_surrogate(text)) is not None:  # not Unicode text: no tokenizer can encode it
        raise ConfigError(f"messages[{index}].content", f"holds a lone surrogate ({bad!a}): not Unicode text")
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
