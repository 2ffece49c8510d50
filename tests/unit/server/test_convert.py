"""The OpenAI response fields ``convert`` writes from a turn's answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

from clm_middleware.server import convert


def test_tool_call_arguments_keep_their_characters_as_openai_returns_them():
    answer = SimpleNamespace(tool_calls=[{"id": "call_1", "name": "weather", "args": {"city": "上海", "note": "é"}}])
    (call,) = convert.tool_calls(answer)  # type: ignore[arg-type]
    assert call["function"]["arguments"] == '{"city": "上海", "note": "é"}'
    assert json.loads(call["function"]["arguments"]) == {"city": "上海", "note": "é"}
