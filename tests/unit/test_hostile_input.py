"""Hostile input at the public entry points: a clear error naming the field, or an answer; never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.server.convert import chat_request
from clm_middleware.server.errors import APIError
from clm_middleware.server.schemas import ChatCompletionRequest

# every code point, lone surrogates and NUL included
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False), ANY_TEXT)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]), "content": JSON},
    optional={"tool_call_id": JSON, "name": JSON, "tool_calls": JSON},
)
BODY = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(MESSAGE, max_size=3)},
    optional={
        name: JSON
        for name in ("tools", "tool_choice", "stop", "n", "temperature", "top_p", "max_tokens", "response_format")
    },
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ANY_TEXT)
def test_any_text_sent_to_a_conversation_is_answered_or_refused_by_field_and_leaves_nothing(converse, text):
    conversation = converse(max_new_tokens=2)
    try:
        reply = conversation.send(text)
    except ConfigError as error:
        assert error.field == "content" and conversation.history == []
    else:
        assert isinstance(reply.text, str) and len(conversation.history) == 2
    finally:
        conversation.close()


@settings(max_examples=300, deadline=None)
@given(body=BODY)
def test_any_json_body_is_a_chat_call_or_a_400_naming_a_field(body):
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        assert error.errors()[0]["loc"]  # FastAPI answers it with a 400 naming this location
        return
    try:
        call = chat_request(request, GenerationSettings(), session_id=None)
    except APIError as error:
        assert error.status == 400 and error.param
        return
    assert call.turns and all(turn.role in ("system", "user", "assistant", "tool") for turn in call.turns)
    json.dumps(request.model_dump(), ensure_ascii=False).encode()  # a call holds Unicode text only


def test_the_server_answers_deep_nesting_and_lone_surrogates_with_400s(server):
    import httpx

    deep = httpx.post(server.api + "/chat/completions", content="[" * 50_000 + "]" * 50_000, timeout=30)
    assert deep.status_code == 400 and set(deep.json()) == {"error"}
    body = '{"model": "x", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    model = httpx.get(server.api + "/models", timeout=30).json()["data"][0]["id"]
    surrogate = httpx.post(
        server.api + "/chat/completions",
        content=body.replace('"x"', f'"{model}"'),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ('"metadata": {"session_id": "s\\ud800"}', "metadata.session_id"),
        ('"user": "bob\\udfff"', "user"),
        (
            '"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]',
            "tools[0].function.description",
        ),
    ],
)
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it_and_stores_nothing(server, field, param):
    """Content was checked before; a session id, a user or a tool description reached the
    store, a hash or the response encoder (a 500, and a session no listing could encode)."""
    import httpx

    model = httpx.get(server.api + "/models", timeout=30).json()["data"][0]["id"]
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, {field}}}'
    with httpx.Client(base_url=server.api, timeout=60) as client:
        answer = client.post("/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param and "lone surrogate" in answer.json()["error"]["message"]
        listing = client.get("/sessions")  # the same keep-alive connection
        assert listing.status_code == 200 and listing.json()["data"] == []


def test_a_json_body_without_a_json_content_type_says_what_to_send(server):
    import httpx

    answer = httpx.post(server.api + "/chat/completions", content='{"model": "m", "messages": []}', timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and "Content-Type: application/json" in error["message"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from live_server import start_server

    live = start_server(tmp_path_factory.mktemp("hostile"), "--max-tokens", "4")
    yield live
    live.stop()
