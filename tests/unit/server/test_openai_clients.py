"""``clm serve`` through the real ``openai`` client and LangChain's ``ChatOpenAI``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

REQUEST_TIMEOUT_S = 60
# no parameters: the reply head writes the whole call (tools.call_head), so even the
# random tiny model returns a complete one; SmolLM2 fills arguments in the integration test
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}},
    },
}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.api, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _chat(client, model_id, messages, session=None, **kwargs):
    headers = {"X-Session-Id": session} if session else None
    return client.chat.completions.create(model=model_id, messages=messages, extra_headers=headers, **kwargs)


def test_a_resent_history_extends_its_session_and_reads_its_prefix_from_the_pool(client, model_id):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "My code is ZX-41."}]
    first = _chat(client, model_id, messages)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens > 0 and first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the weather?"},
    ]
    second = _chat(client, model_id, messages)
    extension = second.model_extra["clm"]
    assert extension["route"] == "extend" and extension["turn"] == 2
    assert extension["conversation_id"] == first.model_extra["clm"]["conversation_id"]
    assert extension["restored"] == [] and 0 <= extension["lifecycle_s"] <= extension["turn_s"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # all but the last partial block
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_a_streamed_reply_equals_the_same_request_unstreamed(client, model_id):
    messages = [{"role": "user", "content": "Tell me about Lisbon trams."}]
    whole = _chat(client, model_id, messages, session="plain-a")
    chunks = list(
        _chat(client, model_id, messages, session="stream-a", stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1  # one completion: one id, one start time


def test_a_required_tool_call_comes_back_parsed_and_its_result_extends_the_session(client, model_id):
    messages = [{"role": "user", "content": "What time is it?"}]
    called = _chat(client, model_id, messages, session="tools", tools=[TIME_TOOL], tool_choice="required")
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_time" and call.id
    assert json.loads(call.function.arguments) == {}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "10:42"},
    ]
    answered = _chat(client, model_id, messages, session="tools", tools=[TIME_TOOL])
    assert answered.model_extra["clm"]["route"] == "extend"
    assert answered.usage.prompt_tokens_details.cached_tokens > 0


def test_a_named_session_is_listed_and_shows_its_context_and_segments(client, model_id, server):
    _chat(client, model_id, [{"role": "user", "content": "Remember the locker code 7781."}], session="inspect-me")
    listed = httpx.get(server.api + "/sessions", timeout=10).json()["data"]
    assert any(s["id"] == "inspect-me" for s in listed)
    detail = httpx.get(server.api + "/sessions/inspect-me", timeout=10).json()
    assert detail["busy"] is False and "7781" in detail["context"]
    assert {s["role"] for s in detail["segments"]} >= {"user", "assistant"}
    assert httpx.get(server.api + "/sessions/nobody", timeout=10).status_code == 404


def test_langchain_chat_openai_pointed_at_the_server_gets_cache_reads(server, model_id):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.api, api_key="unused", model=model_id, max_tokens=8, timeout=REQUEST_TIMEOUT_S)
    history = [HumanMessage("Hello, I am planning a trip to Porto next week.")]
    first = llm.invoke(history)
    history += [AIMessage(first.content), HumanMessage("What should I pack?")]
    second = llm.invoke(history)
    assert isinstance(second.content, str)
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


def test_eight_concurrent_sessions_answer_as_sequential_ones_and_give_back_every_block(client, model_id, server):
    def converse(prefix: str, index: int) -> list[str]:
        messages = [{"role": "user", "content": f"Client {index} asks about topic {index * 7}."}]
        replies = []
        for follow_up in ("Go on.", "Thanks."):
            reply = _chat(client, model_id, messages, session=f"{prefix}-{index}").choices[0].message.content
            replies.append(reply)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
        return replies

    sequential = [converse("seq", i) for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda i: converse("con", i), range(8)))
    assert concurrent == sequential
    for session in httpx.get(server.api + "/sessions", timeout=10).json()["data"]:
        assert httpx.delete(f"{server.api}/sessions/{session['id']}", timeout=10).status_code == 200
    assert server.metric("clm_sessions") == 0
    assert server.metric("clm_pool_blocks_in_use") == 0


def test_metrics_are_prometheus_text_with_the_turn_histogram(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "clm_prompt_tokens_total",
        "clm_cached_tokens_total",
        "clm_turn_seconds_bucket",
        "clm_pool_blocks_free",
    ):
        assert name in text


def test_each_user_is_a_tenant_that_sees_only_its_own_sessions_and_shares_no_cache(client, model_id, server):
    messages = [{"role": "user", "content": "A message both tenants send, word for word."}]
    alice = _chat(client, model_id, messages, session="mine", user="alice")
    bob = _chat(client, model_id, messages, session="mine", user="bob")
    assert bob.usage.prompt_tokens_details.cached_tokens == 0  # alice's blocks are not bob's
    assert alice.model_extra["clm"]["conversation_id"] != bob.model_extra["clm"]["conversation_id"]
    for user in ("alice", "bob"):
        listed = httpx.get(server.api + "/sessions", params={"user": user}, timeout=10).json()["data"]
        assert [s["id"] for s in listed] == [f"user-{_tenant_hash(user)}/mine"]
    assert all(not s["id"].endswith("/mine") for s in httpx.get(server.api + "/sessions", timeout=10).json()["data"])


def test_an_unnamed_session_of_a_tenant_can_be_read_and_deleted_by_its_conversation_id(client, model_id, server):
    """A tenant's conversation ids hold a slash (``user-<hash>/<id>``): the session routes take it."""
    messages = [{"role": "user", "content": "A chat with no session name."}]
    reply = _chat(client, model_id, messages, user="carol")
    conversation_id = reply.model_extra["clm"]["conversation_id"]
    assert conversation_id.startswith(f"user-{_tenant_hash('carol')}/")
    url = f"{server.api}/sessions/{conversation_id}"
    shown = httpx.get(url, params={"user": "carol"}, timeout=10)
    assert shown.status_code == 200 and shown.json()["id"] == conversation_id
    assert httpx.get(url, params={"user": "dave"}, timeout=10).status_code == 404  # another tenant's: not found
    assert httpx.delete(url, params={"user": "carol"}, timeout=10).json()["deleted"] is True
    assert httpx.get(url, params={"user": "carol"}, timeout=10).status_code == 404


def _tenant_hash(user: str) -> str:
    import hashlib

    return hashlib.sha256(user.encode()).hexdigest()[:16]


def test_histories_as_people_have_them_are_answered(client, model_id):
    greeting_first = [
        {"role": "assistant", "content": "Hi! I am the booking bot. How can I help?"},
        {"role": "user", "content": "I need a table."},
        {"role": "user", "content": "For two, tonight."},
    ]
    reply = _chat(client, model_id, greeting_first, session="people")
    assert reply.choices[0].finish_reason in ("stop", "length")
    with_tool = [
        *greeting_first,
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "tool", "tool_call_id": "call_from_elsewhere", "content": "table 12 is free"},
    ]
    assert _chat(client, model_id, with_tool, session="people").model_extra["clm"]["route"] == "extend"
    blank_turns = [  # a chat UI's stray Enter, an empty system prompt: answered, as other servers do
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "Did you mean to write something?"},
        {"role": "user", "content": "   "},
    ]
    blank = _chat(client, model_id, blank_turns, session="blank")
    assert blank.choices[0].finish_reason in ("stop", "length") and blank.usage.prompt_tokens > 0


def test_more_streams_than_turn_slots_all_finish_and_no_slot_is_lost(client, model_id, server):
    def stream(index: int) -> str:
        chunks = _chat(client, model_id, [{"role": "user", "content": f"Stream {index}."}], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(max_workers=10) as pool:  # the server runs 4 turns at once
        texts = list(pool.map(stream, range(10)))
    assert len(texts) == 10
    assert _chat(client, model_id, [{"role": "user", "content": "Still answering?"}]).choices


def test_request_metrics_are_labelled_by_route_not_by_url(server):
    httpx.get(server.api + "/sessions/some-unknown-id", timeout=10)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'endpoint="/v1/sessions/{session_id}"' in text and "some-unknown-id" not in text


# every document of this schema is short: the random tiny model always completes one
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "paid": {"type": "boolean"},
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["paid", "items", "size"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_format_gives_a_document_that_validates(client, model_id, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "The order as JSON."}]
    if stream:
        chunks = list(_chat(client, model_id, messages, response_format=fmt, max_tokens=40, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    else:
        reply = _chat(client, model_id, messages, response_format=fmt, max_tokens=40)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    order = json.loads(text)
    assert finish == "stop" and list(order) == ["paid", "items", "size"]
    assert type(order["paid"]) is bool and 1 <= order["items"] <= 9 and order["size"] in ("S", "M", "L")


def test_a_document_cut_by_max_tokens_says_length(client, model_id):
    messages = [{"role": "user", "content": "The order as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}  # 3 required keys
    reply = _chat(client, model_id, messages, response_format=fmt, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


def test_json_object_gives_a_json_object(client, model_id):
    messages = [{"role": "user", "content": "Any JSON object."}]
    reply = _chat(client, model_id, messages, response_format={"type": "json_object"}, max_tokens=200, seed=3)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_deleting_a_session_name_closes_every_branch_so_the_name_starts_afresh(client, model_id, server):
    first = [{"role": "user", "content": "Branch me."}]
    reply = _chat(client, model_id, first, session="tree").choices[0].message.content
    asked = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    _chat(client, model_id, asked, session="tree")
    regenerated = _chat(client, model_id, asked, session="tree")  # the same history again: a fork
    assert regenerated.model_extra["clm"]["route"] == "fork"
    ids = [s["id"] for s in httpx.get(server.api + "/sessions", timeout=10).json()["data"]]
    assert sum(i.startswith("tree") for i in ids) == 2
    deleted = httpx.delete(server.api + "/sessions/tree", timeout=10)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    ids = [s["id"] for s in httpx.get(server.api + "/sessions", timeout=10).json()["data"]]
    assert not any(i.startswith("tree") for i in ids)
    assert httpx.get(server.api + "/sessions/tree", timeout=10).status_code == 404
    assert _chat(client, model_id, asked, session="tree").model_extra["clm"]["route"] == "new"
