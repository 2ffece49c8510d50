"""Tools for models whose chat template has no tool support, and the calls they write.

Prompt format (documented in docs/tools.md): the system message lists the tools as
JSON schemas and asks for calls written as::

    <tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>

A template that renders ``tools=`` itself (``ChatFormat`` finds where it puts them in
the system message) is used instead. Parsing never raises: a call that is not JSON,
names no known tool, or has non-object arguments becomes an ``invalid_tool_call``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

import regex

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_CALL = regex.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", regex.DOTALL)

PROMPT_HEADER = (
    "You can call tools. To call one, write exactly one line per call:\n"
    '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "Call a tool only when it helps answer; after a tool result arrives, answer the user.\n"
    "Tools:"
)


def tools_prompt(tools: Sequence[dict[str, Any]], template_tools: str | None = None) -> str:
    """The tools section of the system message: the template's own rendering if it has one."""
    if template_tools:
        return template_tools
    lines = [PROMPT_HEADER]
    for tool in tools:
        function = tool.get("function", tool)
        spec = {
            "name": function.get("name"),
            "description": function.get("description", ""),
            "parameters": function.get("parameters", {}),
        }
        lines.append(json.dumps(spec, ensure_ascii=False, sort_keys=True))
    return "\n".join(lines)


def render_tool_calls(calls: Sequence[dict[str, Any]]) -> str:
    payloads = (
        json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False, sort_keys=True) for c in calls
    )
    return "\n".join(f"{OPEN}{payload}{CLOSE}" for payload in payloads)


def split_tool_calls(text: str) -> tuple[str, list[str]]:
    """(text outside tool-call tags, the raw payload of each call)."""
    payloads = [m.group(1) for m in _CALL.finditer(text)]
    start = text.find(OPEN)
    return (text[:start].rstrip() if start >= 0 else text), payloads


def parse_tool_calls(payloads: Sequence[str], known: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """LangChain ``tool_calls`` and ``invalid_tool_calls`` from raw payloads."""
    valid, invalid = [], []
    for payload in payloads:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as error:
            invalid.append(_invalid(None, payload, call_id, f"not valid JSON: {error.msg}"))
            continue
        if not isinstance(data, dict):
            invalid.append(_invalid(None, payload, call_id, "a tool call must be a JSON object"))
            continue
        name = data.get("name")
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # a string of JSON: use what it holds
                arguments = json.loads(arguments)
        if not isinstance(name, str) or (known and name not in known):
            shown = name if isinstance(name, str) else None
            invalid.append(_invalid(shown, payload, call_id, f"unknown tool {name!r}"))
        elif not isinstance(arguments, dict):
            invalid.append(_invalid(name, payload, call_id, "arguments must be a JSON object"))
        else:
            valid.append({"name": name, "args": arguments, "id": call_id, "type": "tool_call"})
    return valid, invalid


def _invalid(name: str | None, payload: str, call_id: str, error: str) -> dict[str, Any]:
    return {"name": name, "args": payload, "id": call_id, "error": error, "type": "invalid_tool_call"}


def forced_prefix(tool_choice: Any, tool_names: Sequence[str]) -> str | None:
    """The start of a reply that makes a tool call certain, for ``tool_choice``.

    ``"auto"``/``None``: the model decides (no prefix). ``"any"``/``"required"``/``True``:
    some tool must be called (the reply opens a call; the model names the tool, or the
    only tool is named). A tool name, or ``{"type": "function", "function": {"name": ...}}``:
    that tool must be called. ``"none"``: no prefix (and the adapter binds no tools).
    """
    if tool_choice in (None, "auto", "none", False):
        return None
    name = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    elif isinstance(tool_choice, str) and tool_choice not in ("any", "required"):
        name = tool_choice
    elif len(tool_names) == 1:
        name = tool_names[0]
    if name is None:
        return OPEN + '{"name": "'
    return OPEN + json.dumps({"name": name})[:-1] + ', "arguments": '


_SENTINEL = "\u2063CLM-SYSTEM\u2064"


def template_tools_section(tokenizer: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """What the chat template adds to the system message when given ``tools=``, if it does.

    Found by rendering a sentinel system message with and without the tools: the
    difference, when it is text appended after the system content, is the section.
    ``None`` when the template has no tool support or puts tools elsewhere.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    messages = [{"role": "system", "content": _SENTINEL}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=list(tools), tokenize=False)
    except Exception:  # a template may reject tools or the message shape
        return None
    if plain.count(_SENTINEL) != 1 or with_tools.count(_SENTINEL) != 1:
        return None
    head, tail = plain.split(_SENTINEL)
    tools_head, tools_rest = with_tools.split(_SENTINEL)
    if tools_head != head or not tools_rest.endswith(tail) or len(tools_rest) <= len(tail):
        return None
    section = tools_rest[: len(tools_rest) - len(tail)].strip()
    return section or None
