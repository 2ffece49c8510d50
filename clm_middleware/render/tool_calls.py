"""How a tool call is written in the context: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

One spelling everywhere (a call re-sent by a client, a recorded call in a replay, the
example in the tools prompt, the grammar of a required call): ``name`` first, then
``arguments`` in the order given, laid out as ``json.dumps`` writes them, which is also
how the model writes a call under the grammar. So the same history renders to the same
tokens whether the server remembers the conversation or rebuilds it from the client's
messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def render_tool_call(name: str, arguments: Any) -> str:
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}{payload}{CLOSE}"


def render_tool_calls(calls: Sequence[dict[str, Any]]) -> str:
    """Each ``{"name", "arguments"}`` call on its own line."""
    return "\n".join(render_tool_call(call["name"], call["arguments"]) for call in calls)
