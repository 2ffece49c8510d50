"""How transcript messages become text in the context (tool calls included)."""

from __future__ import annotations

import contextlib
import json

from clm_middleware.render.tool_calls import render_tool_call
from clm_middleware.replay.transcript import Message


def message_text(message: Message) -> str:
    """The content, followed by each tool call as ``<tool_call>{json}</tool_call>``.

    This is the documented tool-call format for chat templates without native tool
    support (see docs/tools.md); it keeps the call visible to the model verbatim.
    """
    parts = [message.content] if message.content else []
    for call in message.tool_calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: keep the string as given
                arguments = json.loads(arguments)
        parts.append(render_tool_call(function.get("name", ""), arguments))
    return "\n".join(parts)
