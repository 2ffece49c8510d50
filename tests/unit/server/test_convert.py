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


def _request(**fields):
    from clm_middleware.server.schemas import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_the_legacy_functions_api_is_refused_by_name_not_answered_as_if_absent():
    import pytest

    from clm_middleware.lifecycle.config import GenerationSettings
    from clm_middleware.server.errors import APIError

    legacy = {"functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto"}
    for field in ("functions", "function_call"):
        with pytest.raises(APIError) as refused:
            convert.chat_request(_request(**{field: legacy[field]}), GenerationSettings(), None)
        assert (refused.value.status, refused.value.param) == (400, field)
        assert "send tool" in refused.value.message


def test_a_legacy_function_call_history_reads_as_the_tools_api_history():
    from clm_middleware.server.schemas import ChatMessage

    call = {"name": "weather", "arguments": '{"city": "Lisbon"}'}
    legacy = [
        ChatMessage(role="assistant", content=None, function_call=call),
        ChatMessage(role="function", name="weather", content="sunny"),
    ]
    current = [
        ChatMessage(role="assistant", content=None, tool_calls=[{"id": "c1", "function": call}]),
        ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
    ]
    assert [convert.to_turn(m, i) for i, m in enumerate(legacy)] == [
        convert.to_turn(m, i) for i, m in enumerate(current)
    ]


def test_allowed_tools_show_and_offer_only_those_tools_under_their_mode():
    import pytest

    from clm_middleware.lifecycle.config import GenerationSettings
    from clm_middleware.server.errors import APIError

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b", "c")]

    def choice(mode, *names):
        listed = [{"type": "function", "function": {"name": n}} for n in names]
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": listed}}

    call = convert.chat_request(
        _request(tools=tools, tool_choice=choice("required", "c", "a")), GenerationSettings(), None
    )
    assert [t["function"]["name"] for t in call.tools] == ["c", "a"] and call.tool_choice == "required"
    for bad, param in (
        (choice("any", "a"), "tool_choice.allowed_tools.mode"),
        (choice("auto", "a", "zz"), "tool_choice.allowed_tools.tools[1]"),
        (choice("auto"), "tool_choice.allowed_tools.tools"),
        ({"type": "custom", "custom": {"name": "a"}}, "tool_choice.type"),
    ):
        with pytest.raises(APIError) as refused:
            convert.chat_request(_request(tools=tools, tool_choice=bad), GenerationSettings(), None)
        assert (refused.value.status, refused.value.param) == (400, param)
