"""``clm serve`` on SmolLM2-135M, end to end through the real ``openai`` client."""

from __future__ import annotations

import json

import pytest
from live_server import start_server
from openai import OpenAI

from clm_middleware.lifecycle.reply_quality import has_artifact

TURNS = [
    "Hi! I am planning a trip to Lisbon in May.",
    "My booking reference is ZK4R2P.",
    "Which neighbourhood should I stay in?",
    "And what should I eat there?",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory):
    live = start_server(tmp_path_factory.mktemp("serve-smol"), "--budget", "1024", "--max-tokens", "48", model=None)
    yield live
    live.stop()


def test_a_chat_through_the_openai_client_reads_words_and_its_history_from_the_pool(smol_server):
    client = OpenAI(base_url=smol_server.api, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a helpful travel assistant."}]
    shares = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model=model, messages=messages)
        content = reply.choices[0].message.content
        assert content.strip() and not has_artifact(content), content
        shares.append(reply.usage.prompt_tokens_details.cached_tokens / reply.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": content})
    print("cached share per call:", [round(s, 2) for s in shares])
    assert all(share >= 0.8 for share in shares[2:])


def test_a_required_tool_call_on_smollm2_names_the_tool_with_object_arguments(smol_server):
    client = OpenAI(base_url=smol_server.api, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Porto tomorrow?"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("tool_choice", ["none", None])
def test_after_a_tool_result_a_reply_that_may_call_no_tool_answers_instead_of_copying_the_call(
    smol_server, tool_choice
):
    """SmolLM2 given a tool's result copied the call before it as text
    ('<tool_call>{"name": "get_weather", ...}</tool_call>') where no tool may be called
    (tool_choice="none", or no tools sent); it now answers from the result."""
    client = OpenAI(base_url=smol_server.api, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 12°C in Paris."},
    ]
    tools = {"tools": [WEATHER_TOOL], "tool_choice": tool_choice} if tool_choice else {}
    reply = client.chat.completions.create(model=model, messages=messages, **tools)
    message = reply.choices[0].message
    assert not message.tool_calls and message.content.strip(), message
    assert "<" not in message.content and not has_artifact(message.content), message.content
