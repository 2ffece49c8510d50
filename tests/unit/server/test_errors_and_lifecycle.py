"""Every error path of ``clm serve`` answers an OpenAI error object; nothing half-done stays."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.parse

import httpx
import pytest

from clm_middleware.cache.block_pool import POOL_HINT
from clm_middleware.errors import PoolExhaustedError
from clm_middleware.server.errors import clm_error_to_api

TIMEOUT_S = 60
KEY = "s3cret-key"


def _post(url: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(url + "/chat/completions", content=content, headers=headers, timeout=TIMEOUT_S)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


def _other_tool() -> dict:
    return {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _hello(model_id: str, **extra) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"temperature": 5}, "temperature"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**64, "temperature": 1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as OpenAI and vLLM
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        # a part with no type: the union's deepest error, not "content: Input should be a valid string"
        ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
            "tool_choice.function.name",
        ),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (  # OpenAI's API: only an assistant message that calls tools may leave content out
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            "messages[1].content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": None},
                ]
            },
            "messages[2].content",
        ),
        ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "messages[0].content"),
        ({"tool_choice": "required"}, "tool_choice"),
        (  # a name of the wrong type, or a function that is no object: a 400, not a 500
            {"tools": [_other_tool()], "tool_choice": {"type": "function", "function": {"name": ["get_time"]}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [_other_tool()], "tool_choice": {"type": "function", "function": "get_time"}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [_other_tool()],
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": "auto", "tools": [{"function": "x"}]},
                },
            },
            "tool_choice.allowed_tools.tools[0]",
        ),
        ({"tools": [_tool({"type": "object", "properties": "x"})]}, "tools[0].function.parameters.properties"),
        ({"tools": [_tool({"properties": {"city": "string"}})]}, "tools[0].function.parameters.properties"),
        ({"tools": [_tool({"properties": {"city": {}}, "required": "city"})]}, "tools[0].function.parameters.required"),
        ({"tools": [_tool({"type": "string"})]}, "tools[0].function.parameters.type"),
        ({"tools": [_tool({"properties": {"city": {"type": "bogus"}}})]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "my tool!"}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"stream": "yes"}, "stream"),  # a type is checked, not guessed
        ({"max_tokens": True}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"continue_final_message": True}, "continue_final_message"),  # vLLM's "Continue"
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", 1]}, "stop[1]"),  # not "stop.list[str][1]": the union's member is no field
        ({"stop": 5}, "stop"),
        ({"metadata": {"str": 5}}, "metadata.str"),  # a client's key, though it reads as a type's name
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the vocabulary
        (  # a JSON Schema type that does not exist
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
            "response_format.json_schema.schema",
        ),
        (  # the grammar compiler rejects it (a $ref to nothing): still a 400, before the turn
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/$defs/gone"}}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        # a tool schema no grammar can hold, where a grammar writes its call (required, or
        # beside a response_format): refused, never written unconstrained (it came back '{"a": 1}')
        *(
            ({"tools": [_other_tool(), _tool(bad)], **choice}, f"tools[1].{where}")
            for bad, where in [
                ({"properties": {"a": {"type": "array", "items": 5}}}, "function.parameters"),
                ({"properties": {"a": {"type": "integer", "minimum": 10, "maximum": 1}}}, "function.parameters"),
                ({"properties": {"a": {"$ref": "#/$defs/gone"}}, "required": ["a"]}, "function.parameters"),
            ]
            for choice in (
                {"tool_choice": "required"},
                # allowed_tools shows the model the bad tool alone: still named where the client put it
                {
                    "tool_choice": {
                        "type": "allowed_tools",
                        "allowed_tools": {
                            "mode": "required",
                            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                        },
                    }
                },
                {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                {"tool_choice": "auto", "response_format": {"type": "json_object"}},
                {"tool_choice": "required", "stream": True},
            )
        ),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(server, model_id, change, param):
    error = _error(_post(server.api, {**_hello(model_id), **change}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


@pytest.mark.parametrize("content", [5, {"text": "hi"}])
def test_content_of_a_wrong_type_is_named_with_every_type_it_may_have(server, model_id, content):
    """It had said only "Input should be a valid string", though a list of parts is taken too."""
    error = _error(_post(server.api, {**_hello(model_id), "messages": [{"role": "user", "content": content}]}), 400)
    assert error["param"] == "messages[0].content"
    assert error["message"] == "messages[0].content: Input should be a valid string, or a valid list"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_number_that_is_not_finite_is_a_400_saying_so(server, model_id, value):
    body = json.dumps(_hello(model_id, temperature=0.5)).replace("0.5", value)
    error = _error(_post(server.api, body), 400)
    assert error["param"] == "temperature" and "finite number" in error["message"]


def test_a_tool_pattern_the_grammar_engine_lacks_is_left_to_the_tool_and_the_call_is_made(server, model_id):
    # \\p{L} and \\b are valid regular expressions xgrammar cannot compile: the rest still binds the call
    name = {"type": "string", "pattern": "^\\p{L}+\\b"}
    tool = _tool({"type": "object", "properties": {"city": name, "days": {"type": "integer"}}, "required": ["city"]})
    response = _post(server.api, {**_hello(model_id), "tools": [tool], "tool_choice": "required", "max_tokens": 40})
    assert response.status_code == 200, response.text
    call = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


def test_null_for_an_optional_field_means_its_default(server, model_id):
    nulls = {"n": None, "stream": None, "frequency_penalty": None, "presence_penalty": None}
    response = _post(server.api, {**_hello(model_id), **nulls, "max_tokens": 4})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    streamed = _post(server.api, {**_hello(model_id), "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_a_nullable_argument_type_list_is_served_and_a_required_call_is_made(server, model_id):
    # OpenAI's strict mode writes an optional argument as {"type": ["string", "null"]}
    tool = _tool({"type": "object", "properties": {"city": {"type": ["string", "null"]}}, "required": ["city"]})
    response = _post(server.api, {**_hello(model_id), "tools": [tool], "tool_choice": "required", "max_tokens": 40})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_json_schema_whose_root_is_not_an_object_is_served(server, model_id):
    schema = {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 1, "maxItems": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "colours", "schema": schema}}
    response = _post(server.api, {**_hello(model_id), "response_format": fmt, "max_tokens": 40})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) <= {"red", "blue"}


def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(server, model_id):
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": schema, "strict": True}}
    error = _error(_post(server.api, {**_hello(model_id), "response_format": fmt}), 400)
    assert error["param"] == "response_format.json_schema.schema"
    assert "'uniqueItems' at /properties/tags" in error["message"]


def test_a_required_call_wins_over_a_response_format(server, model_id):
    # as on OpenAI: response_format shapes a text answer; a required tool call is still made
    tool = _tool({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    body = {**_hello(model_id), "tools": [tool], "tool_choice": "required", "max_tokens": 40}
    response = _post(server.api, {**body, "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )


def test_a_message_no_context_could_hold_is_a_400_before_any_work(server, model_id):
    # at the longest token's length its characters alone rule it out (an 8 MB one had been a 500)
    body = {"model": model_id, "messages": [{"role": "user", "content": "The cat sat. " * 200_000}]}
    error = _error(_post(server.api, body), 400)
    assert error["code"] == "context_length_exceeded" and "2,600,000 characters" in error["message"]


def test_a_body_that_is_not_json_is_a_400(server):
    error = _error(_post(server.api, "{not json"), 400)
    assert "JSON" in error["message"]


def test_an_empty_body_is_a_400_saying_it_is_empty(server):
    assert "body is empty" in _error(_post(server.api, b""), 400)["message"]


def test_a_method_a_route_does_not_serve_is_a_405_naming_the_allowed_ones(server):
    response = httpx.post(server.api + "/models", timeout=TIMEOUT_S)
    _error(response, 405)
    assert response.headers["allow"] == "GET"  # RFC 9110: a 405 says what the route allows


def test_an_unknown_model_is_a_404_of_openais_shape(server, model_id):
    error = _error(_post(server.api, _hello("gpt-5")), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"  # OpenAI's type for it
    assert _error(httpx.get(server.api + "/models/gpt-5", timeout=TIMEOUT_S), 404)["code"] == "model_not_found"
    assert httpx.get(f"{server.api}/models/{model_id}", timeout=TIMEOUT_S).json()["id"] == model_id


def test_a_prompt_over_the_context_window_is_a_400_and_the_session_is_left_as_it_was(server, model_id):
    session = {"X-Session-Id": "too-long"}
    first = _post(server.api, _hello(model_id), session).json()
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    huge = {"role": "user", "content": "word " * 1200}  # over the tiny model's 4,096 positions
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    own = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    for added in ([huge], [*own, huge]):  # the client's own assistant and tool messages are taken back too
        error = _error(_post(server.api, {**_hello(model_id), "messages": [*history, *added]}, session), 400)
        assert error["code"] == "context_length_exceeded"
        assert "budget=" not in error["message"] and "shorten the messages" in error["message"]  # the client's terms
        assert httpx.get(server.api + "/sessions/too-long", timeout=TIMEOUT_S).json()["messages"] == 2
    short = {"role": "user", "content": "short again"}
    retried = _post(server.api, {**_hello(model_id), "messages": [*history, short]}, session).json()
    assert retried["clm"]["route"] == "extend" and retried["clm"]["turn"] == 2


def test_a_client_that_leaves_mid_stream_cancels_its_turn_and_frees_its_blocks(server, model_id):
    session = {"X-Session-Id": "leaver"}
    first = _post(server.api, _hello(model_id), session).json()
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    messages = [*history, {"role": "user", "content": "Write a very long story."}]
    body = {"model": model_id, "messages": messages, "max_tokens": 3000, "stream": True}
    headers = {"Content-Type": "application/json", **session}
    with httpx.stream("POST", server.api + "/chat/completions", json=body, headers=headers, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk: the turn is running
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(server.api + "/sessions/leaver", timeout=TIMEOUT_S).json()["busy"]:
        assert time.monotonic() < deadline, "the cancelled turn never ended"
        time.sleep(0.1)
    detail = httpx.get(server.api + "/sessions/leaver", timeout=TIMEOUT_S).json()
    assert detail["messages"] == 2 and detail["turns"] == 1  # the cancelled turn left nothing
    retried = _post(server.api, {**body, "stream": False, "max_tokens": 4}, session).json()
    assert retried["clm"]["route"] == "extend" and retried["clm"]["turn"] == 2
    assert httpx.delete(server.api + "/sessions/leaver", timeout=TIMEOUT_S).status_code == 200


def test_the_same_request_sent_right_after_a_stopped_stream_extends_the_session(server, model_id):
    """A chat UI's stop, then send again: the stopped turn was not undone yet when the
    request arrived, and the session forked a branch per stop (a helper's probe)."""
    session = {"X-Session-Id": "stopper"}
    first = _post(server.api, _hello(model_id), session).json()
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    body = {"model": model_id, "messages": [*history, {"role": "user", "content": "Write a very long story."}]}
    headers = {"Content-Type": "application/json", **session}
    streamed = {**body, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", server.api + "/chat/completions", json=streamed, headers=headers, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk: the turn is running
    again = _post(server.api, {**body, "max_tokens": 4}, session).json()  # at once
    assert again["clm"]["route"] == "extend" and again["clm"]["turn"] == 2
    assert httpx.delete(server.api + "/sessions/stopper", timeout=TIMEOUT_S).status_code == 200


def test_a_client_that_leaves_a_non_streaming_request_cancels_its_turn(server, model_id):
    session = {"X-Session-Id": "impatient"}
    first = _post(server.api, _hello(model_id), session).json()
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    messages = [*history, {"role": "user", "content": "Write a very long story."}]
    body = {"model": model_id, "messages": messages, "max_tokens": 4000}
    headers = {"Content-Type": "application/json", **session}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 4,000 tokens
        httpx.post(server.api + "/chat/completions", json=body, headers=headers, timeout=1.0)
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(server.api + "/sessions/impatient", timeout=TIMEOUT_S).json()["busy"]:
        assert time.monotonic() < deadline, "the abandoned turn never ended"
        time.sleep(0.1)
    detail = httpx.get(server.api + "/sessions/impatient", timeout=TIMEOUT_S).json()
    assert detail["messages"] == 2 and detail["turns"] == 1  # cancelled, not run to its end
    retried = _post(server.api, {**body, "max_tokens": 4}, session).json()
    assert retried["clm"]["route"] == "extend" and retried["clm"]["turn"] == 2


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, launch):
    """API key required; a pool of 24 blocks (384 tokens of the tiny model)."""
    live = launch(tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-kv-bytes", str(24 * 8192))
    yield live
    assert live.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in live.log.read_text()  # sessions and engine closed


def test_with_an_api_key_a_missing_or_wrong_key_is_a_401(guarded):
    model = httpx.get(guarded.api + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    model_id = model.json()["data"][0]["id"]
    assert _error(_post(guarded.api, _hello(model_id)), 401)["code"] == "invalid_api_key"
    _error(_post(guarded.api, _hello(model_id), {"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(guarded.api + "/models", timeout=TIMEOUT_S), 401)
    assert _post(guarded.api, _hello(model_id), {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(guarded.url + "/health", timeout=TIMEOUT_S).status_code == 200  # probes need no key


def test_a_keys_tenant_name_does_not_give_the_key_away(guarded):
    """The tenant prefixes conversation ids in the store; it was an unsalted SHA-256 of
    the key, so a short key was found by trying keys against a store (a helper's sweep)."""
    import hashlib

    auth = {"Authorization": f"Bearer {KEY}"}
    model_id = httpx.get(guarded.api + "/models", headers=auth, timeout=TIMEOUT_S).json()["data"][0]["id"]
    reply = _post(guarded.api, {**_hello(model_id), "max_tokens": 1}, {**auth, "X-Session-Id": "mine"}).json()
    tenant = reply["clm"]["conversation_id"].split("/")[0]
    assert tenant.startswith("key-") and len(tenant) == len("key-") + 16
    assert tenant != "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
    expected = hashlib.pbkdf2_hmac("sha256", KEY.encode(), b"clm-middleware tenant of an API key", 200_000)
    assert tenant == "key-" + expected.hex()[:16]  # stable across restarts: a store keeps finding its ids


def test_a_request_larger_than_the_whole_pool_is_a_400_context_length_exceeded_and_holds_nothing(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    model_id = httpx.get(guarded.api + "/models", headers=auth, timeout=TIMEOUT_S).json()["data"][0]["id"]
    held = guarded.metric("clm_pool_blocks_in_use")
    body = {**_hello(model_id), "messages": [{"role": "user", "content": "x " * 400}]}
    response = _post(guarded.api, body, auth)
    error = _error(response, 400)  # no wait makes it fit: a client that retried a 503 would retry in vain
    assert error["code"] == "context_length_exceeded" and "Retry-After" not in response.headers
    assert "the pool has 24 in all" in error["message"]
    # in the request's terms and the server's flags, not the library's arguments
    assert "max_tokens" in error["message"] and "--max-kv-bytes" in error["message"]
    assert "max_new_tokens" not in error["message"] and "max_blocks" not in error["message"]
    assert guarded.metric("clm_pool_blocks_in_use") == held
    streamed = _post(guarded.api, {**body, "stream": True}, auth)  # fails before its first token:
    assert _error(streamed, 400)["code"] == "context_length_exceeded"  # a real status, not a 200 stream
    assert _post(guarded.api, _hello(model_id), auth).status_code == 200  # the server goes on


def test_idle_sessions_holding_the_pool_never_turn_a_new_chat_away(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    model_id = httpx.get(guarded.api + "/models", headers=auth, timeout=TIMEOUT_S).json()["data"][0]["id"]
    for number in range(10):  # ten chats of ~5 blocks each left open, in a pool of 24 blocks
        message = {"role": "user", "content": f"chat {number}: what should I pack for a week in Lisbon?"}
        response = _post(guarded.api, {**_hello(model_id), "messages": [message]}, auth)
        assert response.status_code == 200, response.text
    assert guarded.metric("clm_pool_blocks_in_use") <= 24
    assert guarded.metric("clm_sessions") >= 10  # they gave their blocks back, and stay open


def test_a_busy_pool_is_a_503_with_retry_after():
    api = clm_error_to_api(PoolExhaustedError("the KV pool cannot supply 3 blocks", hint=POOL_HINT))
    assert (api.status, api.code, api.retry_after) == (503, "pool_exhausted", 1)
    assert "Retry-After" in api.message and "--max-kv-bytes" in api.message and "max_blocks" not in api.message
    assert api.body()["error"]["type"] == "service_unavailable_error"  # OpenAI's type for a 503


def test_text_parts_of_a_message_reach_the_model_one_per_line(server, model_id):
    parts = [{"type": "text", "text": "Translate to Spanish:"}, {"type": "text", "text": "Good morning"}]
    body = {**_hello(model_id), "messages": [{"role": "user", "content": parts}]}
    assert _post(server.api, body, {"X-Session-Id": "parts"}).status_code == 200
    context = httpx.get(server.api + "/sessions/parts", timeout=TIMEOUT_S).json()["context"]
    assert "Translate to Spanish:\nGood morning" in context


def test_an_assistant_refusal_part_in_the_history_reaches_the_model_as_its_text(server, model_id):
    messages = [
        {"role": "user", "content": "Tell me a secret."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot share secrets."}]},
        {"role": "user", "content": "Then a joke."},
    ]
    response = _post(server.api, {**_hello(model_id), "messages": messages}, {"X-Session-Id": "refusal"})
    assert response.status_code == 200, response.text
    context = httpx.get(server.api + "/sessions/refusal", timeout=TIMEOUT_S).json()["context"]
    assert "I cannot share secrets." in context


def test_cors_is_off_by_default_allowed_origins_answer_preflights_and_others_get_an_error_object(
    server, launch, tmp_path
):
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    closed = httpx.options(server.api + "/chat/completions", headers=preflight, timeout=TIMEOUT_S)
    assert "access-control-allow-origin" not in closed.headers  # same-origin only unless asked
    assert _error(closed, 400)["code"] == "cors_not_allowed"  # as serve.md says (it was a plain 405)
    plain = httpx.get(server.api + "/models", headers={"Origin": "http://ui.example"}, timeout=TIMEOUT_S)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    live = launch(tmp_path, "--allowed-origins", "http://ui.example")
    try:
        asked = {**preflight, "Access-Control-Request-Headers": "authorization, content-type"}
        opened = httpx.options(live.api + "/chat/completions", headers=asked, timeout=TIMEOUT_S)
        assert opened.status_code == 200 and opened.headers["access-control-allow-origin"] == "http://ui.example"
        models = httpx.get(live.api + "/models", headers={"Origin": "http://ui.example"}, timeout=TIMEOUT_S)
        assert models.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.options(
            live.api + "/chat/completions", headers={**asked, "Origin": "http://evil.example"}, timeout=TIMEOUT_S
        )
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        error = _error(other, 400)  # an error object like every other, not starlette's plain text
        assert error["code"] == "cors_not_allowed" and error["param"] == "origin"
        assert "--allowed-origins" in error["message"]
    finally:
        live.stop()


def test_a_forked_session_lists_the_turns_of_the_history_it_shares(server, model_id):
    messages = [{"role": "user", "content": "fork me: first"}]
    for text in ("fork me: second", "fork me: third", None):
        answer = _post(server.api, {"model": model_id, "messages": messages, "max_tokens": 4}).json()
        messages += [answer["choices"][0]["message"]] + ([{"role": "user", "content": text}] if text else [])
    edited = [*messages[:-2], {"role": "user", "content": "fork me: another third"}]  # the third asked again
    forked = _post(server.api, {"model": model_id, "messages": edited, "max_tokens": 4}).json()
    assert forked["clm"]["route"] == "fork" and forked["clm"]["turn"] == 3
    listed = httpx.get(server.api + "/sessions", timeout=TIMEOUT_S).json()["data"]
    session = next(s for s in listed if s["id"] == forked["clm"]["conversation_id"])
    assert session["turns"] == 3  # not 1: the fork shares two answered turns


def test_a_client_replaying_another_clients_chat_extends_its_own_branch_instead_of_forking_every_turn(server, model_id):
    texts = ["replay me: first", "replay me: second", "replay me: third"]
    first: list[dict] = []
    for text in texts:  # the original chat, three turns
        first.append({"role": "user", "content": text})
        answer = _post(server.api, {"model": model_id, "messages": first, "max_tokens": 4}).json()
        first.append(answer["choices"][0]["message"])
    routes, ids = [], set()
    for end in (1, 3, 5):  # a second client sends the same messages again, turn by turn
        answer = _post(server.api, {"model": model_id, "messages": first[:end], "max_tokens": 4}).json()
        routes.append(answer["clm"]["route"])
        ids.add(answer["clm"]["conversation_id"])
    # its first turn forks the original (a regenerated answer); from then on it extends that branch
    assert routes == ["fork", "extend", "extend"] and len(ids) == 1


def test_a_budget_no_message_fits_in_fails_the_start_and_says_why(tmp_path):
    """With --tagging free the protocol prompt is in every prompt: a budget it fills
    passed /health and then answered every chat with a 400."""
    import subprocess

    from live_server import CLM, free_port

    command = [CLM, "serve", "--model", "tiny", "--port", str(free_port()), "--tagging", "free", "--budget", "64"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert done.returncode == 1 and "leaves no room for a message in a budget of 64" in done.stderr


def test_a_session_name_sent_as_utf8_in_the_header_keeps_its_letters(server, model_id):
    """httpx and the openai SDK send a non-ASCII header as UTF-8; read as latin-1 it had
    become 'Ã¼nÃ¯', a session the sessions API could not find."""
    name = "ünï 🙂"
    reply = _post(server.api, {**_hello(model_id), "max_tokens": 2}, {"X-Session-Id": name.encode()}).json()
    assert reply["clm"]["conversation_id"].endswith(name)
    found = httpx.get(f"{server.api}/sessions/{urllib.parse.quote(name)}", timeout=TIMEOUT_S)
    assert found.status_code == 200, found.text
