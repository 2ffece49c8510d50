"""ChatCLM in an agent loop, driven by scripted token-level replies through the real adapter and engine."""

import asyncio
import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from clm_middleware.adapters.tools import parse_tool_calls, signature
from clm_middleware.errors import ConfigError


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'


def test_bind_tools_tool_call_tool_message_final_answer(scripted_llm):
    llm, script = scripted_llm(CALL, "The weather in Porto is sunny.")
    agent = llm.bind_tools({"weather": get_weather, "add": add}.values())  # any iterable, as ChatOpenAI takes
    question = HumanMessage("What is the weather in Porto?")
    call = agent.invoke([question])
    assert call.content == ""
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Porto"})]
    assert call.response_metadata["finish_reason"] == "tool_calls"
    result = get_weather.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage)
    final = agent.invoke([question, call, result])
    assert final.content == "The weather in Porto is sunny."
    assert not final.tool_calls
    # the second call extended the same conversation: its whole prefix was served from the pool
    assert final.response_metadata["conversation_id"] == call.response_metadata["conversation_id"]
    assert final.usage_metadata["input_token_details"]["cache_read"] > call.usage_metadata["input_tokens"] // 2
    assert script.remaining == 0


def test_streamed_tool_calls_arrive_parsed_and_never_as_text(scripted_llm):
    llm, _ = scripted_llm("Let me check. " + CALL)
    chunks = list(llm.bind_tools([get_weather]).stream("Weather in Porto?"))
    assert "<tool_call>" not in "".join(c.content for c in chunks)
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.content == "Let me check."
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("get_weather", {"city": "Porto"})]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] > 0


def test_malformed_or_unknown_calls_become_invalid_tool_calls_not_errors(scripted_llm):
    broken = '<tool_call>{"name": "get_weather", "arguments": {city: }</tool_call>'
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    llm, _ = scripted_llm(broken + unknown)
    message = llm.bind_tools([get_weather], parallel_tool_calls=True).invoke("Weather?")
    assert message.tool_calls == []
    errors = [c["error"] for c in message.invalid_tool_calls]
    assert len(errors) == 2 and "not valid JSON" in errors[0] and "unknown tool 'launch'" in errors[1]
    # all the reply held was calls nothing can run: what the user got is empty, and flagged so
    assert (
        message.content == ""
        and "empty" in llm.conversation(message.response_metadata["conversation_id"]).turn_log[-1].reply_flags
    )


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>{"name": "launch", "arguments": {"when": "now"}}</tool_call>',  # no such tool
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',  # missing a required argument
        '<tool_call>{"name": "get_wea',  # cut by max_tokens
    ],
)
def test_a_summed_stream_never_turns_an_invalid_call_into_a_valid_one(scripted_llm, call):
    """LangChain sums stream chunks with ``+`` (agents, LangGraph's message stream), which
    re-derives calls from tool-call chunks by partial JSON parsing: an invalid call must
    not come out of that sum as a call to run."""
    llm, _ = scripted_llm("Let me check. " + call, "Let me check. " + call)
    agent = llm.bind_tools([get_weather])
    invoked = agent.invoke("Weather?")
    assert invoked.tool_calls == [] and len(invoked.invalid_tool_calls) == 1
    full = None
    for chunk in agent.stream("Weather?"):
        full = chunk if full is None else full + chunk
    assert full.tool_calls == [] and full.content == invoked.content


def test_tool_choice_opens_the_reply_with_the_required_call(scripted_llm):
    llm, _ = scripted_llm('Faro"}}</tool_call>')  # the call head, the one key and its opening quote are forced
    message = llm.bind_tools([get_weather, add], tool_choice="get_weather").invoke("Tell me something.")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Faro"})]


def test_structured_output_by_function_calling_and_json_schema(scripted_llm):
    class City(BaseModel):
        name: str
        population: int

    after_call_head = '"name": "Lisbon", "population": 545000}}</tool_call>'  # the head and "{" are forced
    after_brace = '"name": "Porto", "population": 232000}'  # json_schema forces the opening "{"
    llm, _ = scripted_llm(after_call_head, after_brace)
    assert llm.with_structured_output(City).invoke("A city?") == City(name="Lisbon", population=545000)
    assert llm.with_structured_output(City, method="json_schema").invoke("Another?") == City(
        name="Porto", population=232000
    )


def test_system_messages_and_usage_metadata_report_pool_hits(scripted_llm):
    llm, _ = scripted_llm("Hello!", "Bye!")
    history = [SystemMessage("You are terse."), HumanMessage("Hi")]
    first = llm.invoke(history)
    second = llm.invoke([*history, first, HumanMessage("Bye")])
    usage = second.usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert (
        usage["input_token_details"]["cache_read"]
        == second.response_metadata["lifecycle"]["context_tokens"] - second.response_metadata["prefill_tokens"]
    )
    assert second.response_metadata["pool"]["blocks_in_use"] > 0


def test_async_invoke_and_stream(scripted_llm):
    llm, _ = scripted_llm("One.", "Two.")

    async def run():
        first = await llm.ainvoke("Count")
        pieces = [chunk.content async for chunk in llm.astream("Again")]
        return first, "".join(pieces)

    first, streamed = asyncio.run(run())
    assert first.content == "One." and streamed == "Two."


def test_an_ai_message_from_the_caller_is_kept_as_said(scripted_llm):
    llm, _ = scripted_llm("Fine.")
    reply = llm.invoke([HumanMessage("Hi"), AIMessage("Hello, how can I help?"), HumanMessage("All good?")])
    assert reply.content == "Fine."


def conversation_behind(llm, message):
    """The managed conversation that answered ``message``, through the public look-up."""
    conversation = llm.conversation(message.response_metadata["conversation_id"])
    assert conversation is not None and llm.conversation("no-such-id") is None
    return conversation


def test_a_reply_ends_with_its_first_tool_call_so_the_context_holds_only_what_the_client_sees(scripted_llm):
    llm, _ = scripted_llm(CALL + "\n\nThe weather in Porto is a tropical island.")
    message = llm.bind_tools([get_weather]).invoke("What is the weather in Porto?")
    assert message.content == "" and [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.usage_metadata["output_tokens"] <= len(CALL)  # ended at the closing tag (byte tokens)
    assert conversation_behind(llm, message).history[-1].content == CALL


def test_parallel_tool_calls_lets_one_reply_make_several_calls(scripted_llm):
    second = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    llm, _ = scripted_llm(CALL + "\n" + second)
    message = llm.bind_tools([get_weather, add], parallel_tool_calls=True).invoke("Weather, and 2 + 3?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Porto"}),
        ("add", {"a": 2, "b": 3}),
    ]


def test_without_bound_tools_a_call_written_in_the_reply_is_text(scripted_llm):
    llm, _ = scripted_llm(CALL)
    history = [
        HumanMessage("Weather in Porto?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Porto"}, "id": "c1"}]),
    ]
    history += [ToolMessage("sunny", tool_call_id="c1"), HumanMessage("And again?")]
    message = llm.invoke(history)
    assert message.tool_calls == [] and message.invalid_tool_calls == []
    assert message.content == CALL and message.response_metadata["finish_reason"] == "stop"


def test_a_call_missing_a_required_argument_is_invalid(scripted_llm):
    llm, _ = scripted_llm('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    message = llm.bind_tools([add]).invoke("2 + 3?")
    assert message.tool_calls == []
    assert [c["error"] for c in message.invalid_tool_calls] == ["missing required argument 'b'"]


def test_a_required_call_is_written_under_the_tools_schema_so_no_required_argument_is_missing(scripted_llm):
    llm, _ = scripted_llm('"a": 2}}</tool_call>')  # the script would leave out b
    message = llm.bind_tools([add], tool_choice="add").invoke("2 + 3?", max_tokens=64)
    # the grammar wrote b where the script closed the object; the random model then writes
    # digits, a loop the grammar ends (close_number), and the call completes
    [call] = message.tool_calls
    assert call["name"] == "add" and call["args"]["a"] == 2 and isinstance(call["args"]["b"], int)
    assert (
        "number_loop_closed" in llm.conversation(message.response_metadata["conversation_id"]).turn_log[-1].reply_flags
    )


def test_a_required_call_cut_by_max_tokens_is_never_passed_as_valid(scripted_llm):
    llm, _ = scripted_llm('"a": 2, "b": 3}}</tool_call>')
    message = llm.bind_tools([add], tool_choice="add").invoke("2 + 3?", max_tokens=6)
    assert message.tool_calls == []
    [call] = message.invalid_tool_calls
    assert call["args"].startswith('{"name": "add", "arguments": {"a": ')
    assert call["name"] == "add"
    assert call["error"] == "the reply reached max_tokens before this call was complete; raise max_tokens"


def test_a_call_renders_the_same_whether_the_conversation_is_remembered_or_rebuilt(scripted_llm):
    remembered, _ = scripted_llm(CALL, "Sunny.")
    rebuilt, _ = scripted_llm("Sunny.")
    question = HumanMessage("What is the weather in Porto?")
    call = remembered.bind_tools([get_weather]).invoke([question])
    history = [question, call, ToolMessage("sunny", tool_call_id=call.tool_calls[0]["id"])]
    answers = [llm.bind_tools([get_weather]).invoke(history) for llm in (remembered, rebuilt)]
    assert [a.response_metadata["conversation_id"] == call.response_metadata["conversation_id"] for a in answers] == [
        True,
        False,
    ]
    contexts = [conversation_behind(llm, a).context for llm, a in zip((remembered, rebuilt), answers, strict=True)]
    assert contexts[0] == contexts[1] and CALL in contexts[0]


@pytest.mark.parametrize(
    ("payload", "name"),
    [('{"name": "add", "arguments": {"a": 1', "add"), ('{"name": "ad', None), ('{"nam', None)],
)
def test_a_cut_call_is_invalid_and_names_its_tool_when_the_name_was_written_whole(payload, name):
    valid, [invalid] = parse_tool_calls([payload], [convert_to_openai_tool(add)], last_cut=True)
    assert valid == [] and (invalid["name"], invalid["args"]) == (name, payload)


def test_an_invalid_call_that_parsed_reports_its_arguments_as_args():
    payload = '{"name": "book_table", "arguments": {"people": 2}}'
    valid, [invalid] = parse_tool_calls([payload], [convert_to_openai_tool(add)])
    assert valid == [] and invalid["name"] == "book_table" and json.loads(invalid["args"]) == {"people": 2}
    assert invalid["error"] == "unknown tool 'book_table'"


def test_a_call_cut_in_its_closing_tag_was_written_whole_and_is_valid():
    payload = '{"name": "add", "arguments": {"a": 12, "b": 345}}</tool_'
    [valid], invalid = parse_tool_calls([payload], [convert_to_openai_tool(add)], last_cut=True)
    assert invalid == [] and (valid["name"], valid["args"]) == ("add", {"a": 12, "b": 345})


def test_a_call_cut_by_max_tokens_is_invalid_and_the_reply_ends_by_length(scripted_llm):
    llm, _ = scripted_llm('<tool_call>{"name": "add", "arguments": {"a": 12, "b": 345}}</tool_call>')
    message = llm.bind_tools([add]).invoke("Add 12 and 345.", max_tokens=16)
    assert message.tool_calls == []
    assert [c["error"] for c in message.invalid_tool_calls] == [
        "the reply reached max_tokens before this call was complete; raise max_tokens"
    ]
    assert message.response_metadata["finish_reason"] == "length"


def test_text_that_only_looks_like_the_start_of_a_call_is_given_back_at_the_end(scripted_llm):
    for text in ("Is 3 < 4? Yes: 3 <", "Use the <tool"):
        llm, _ = scripted_llm(text, "Fine.")
        agent = llm.bind_tools([get_weather])
        question = [HumanMessage("A question?")]
        reply = agent.invoke(question)
        assert reply.content == text
        streamed = "".join(chunk.content for chunk in llm.bind_tools([get_weather]).stream("Another?"))
        assert streamed == "Fine."
        # the client's copy of the reply is the conversation's: re-sending it extends, never forks
        after = agent.invoke([*question, reply, HumanMessage("And then?")])
        assert after.response_metadata["conversation_id"] == reply.response_metadata["conversation_id"]


def test_a_tool_choice_naming_no_bound_tool_is_refused_in_every_spelling(scripted_llm):
    llm, _ = scripted_llm("Fine.")
    for choice in (
        "get_wether",
        {"type": "function", "function": {"name": "get_wether"}},
        {"type": "tool", "name": "x"},
    ):
        with pytest.raises(ValueError, match=r"tool_choice: .* names no bound tool"):
            llm.bind_tools([get_weather], tool_choice=choice)
    spec = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="tool_choice: 'get_wether' names no bound tool"):
        llm.bind(tools=[spec], tool_choice="get_wether").invoke("Weather?")
    assert llm.invoke("Still there?").content == "Fine."  # nothing was left half-done


@pytest.mark.parametrize("choice", ["any", "required", True, "get_weather"])
def test_a_call_required_with_no_tool_bound_is_refused_at_bind(scripted_llm, choice):
    llm, _ = scripted_llm("Fine.")
    with pytest.raises(ValueError, match=r"tool_choice: .* requires a tool call, but no tools are bound"):
        llm.bind_tools([], tool_choice=choice)
    assert llm.bind_tools([], tool_choice="auto").invoke("Hi").content == "Fine."


def test_a_named_reply_sent_back_extends_the_conversation(scripted_llm):
    """LangGraph and AutoGen set ``name`` on the replies they send back; the model never
    sees it, so it must not make the history look edited."""
    llm, _ = scripted_llm("Hello.", "Bye.")
    first = llm.invoke([HumanMessage("Hi.")])
    named = AIMessage(content=first.content, name="assistant_agent")
    second = llm.invoke([HumanMessage("Hi."), named, HumanMessage("Bye?")])
    assert second.response_metadata["conversation_id"] == first.response_metadata["conversation_id"]


def _with_new_call_ids(history: list, fresh: str) -> list:
    """The history as a framework that makes new tool-call ids on every re-send sends it."""
    out = []
    for message in history:
        if isinstance(message, AIMessage) and message.tool_calls:
            calls = [{**c, "id": f"{c['id'].split('~')[0]}~{fresh}"} for c in message.tool_calls]
            message = AIMessage(message.content, tool_calls=calls)
        elif isinstance(message, ToolMessage):
            message = ToolMessage(message.content, tool_call_id=f"{message.tool_call_id.split('~')[0]}~{fresh}")
        out.append(message)
    return out


def test_a_history_re_sent_with_new_tool_call_ids_extends_the_conversation(scripted_llm):
    """Some frameworks make new tool-call ids each time they re-send a history; the model
    never sees the ids, so the history is the same one and must not fork."""
    llm, _ = scripted_llm(CALL, "Sunny in Porto.", CALL, "Still sunny.")
    agent = llm.bind_tools([get_weather])
    history: list = [HumanMessage("Weather in Porto?")]
    conversation_ids = set()
    for round_number in range(2):
        call = agent.invoke(_with_new_call_ids(history, f"a{round_number}"))
        conversation_ids.add(call.response_metadata["conversation_id"])
        history += [call, ToolMessage("sunny", tool_call_id=call.tool_calls[0]["id"])]
        answer = agent.invoke(_with_new_call_ids(history, f"b{round_number}"))
        conversation_ids.add(answer.response_metadata["conversation_id"])
        assert answer.response_metadata["turn"] == 2 * round_number + 2  # extended, not rebuilt
        history += [AIMessage(answer.content), HumanMessage("And now?")]
    assert len(conversation_ids) == 1


def test_a_nullable_argument_is_shown_as_a_type_union():
    tool = {"name": "find", "parameters": {"type": "object", "properties": {"city": {"type": ["string", "null"]}}}}
    assert signature(tool) == "- find(city?: string | null)"


def test_an_optional_argument_as_pydantic_writes_it_is_shown_as_a_type_union():
    @tool
    def forecast(city: str, days: int | None = None) -> str:
        """The forecast for a city."""
        return city

    assert signature(convert_to_openai_tool(forecast)) == "- forecast(city: string, days?: integer | null): " + (
        "The forecast for a city."
    )


def test_a_tool_with_a_set_argument_binds_and_its_call_is_constrained(scripted_llm):
    # pydantic writes a set as uniqueItems, which no grammar enforces: the tool, not the binding, checks it
    class Tag(BaseModel):
        """Tag a photo."""

        labels: set[str]

    llm, _ = scripted_llm('<tool_call>{"name": "Tag", "arguments": {"labels": ["sea"]}}</tool_call>')
    message = llm.bind_tools([Tag], tool_choice="Tag").invoke("Tag the beach photo.")
    assert isinstance(message.tool_calls[0]["args"]["labels"], list)


def test_binding_a_tool_with_malformed_parameters_is_an_error_naming_the_field(scripted_llm):
    llm, _ = scripted_llm("hi")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}
    with pytest.raises(ConfigError, match=r"tools\[0\]\.function\.parameters\.required"):
        llm.bind_tools([bad])


def test_a_required_tool_schema_no_grammar_can_hold_is_refused_at_the_call_and_the_chat_is_unchanged(scripted_llm):
    llm, _ = scripted_llm("hi", "hi")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"$ref": "#/$defs/x"}}}}}
    bound = llm.bind_tools([get_weather, bad], tool_choice="any")  # the model may pick f: its grammar must hold
    with pytest.raises(ConfigError, match=r"tools\[1\]\.function\.parameters"):
        bound.invoke("Weather?")
    assert llm.invoke("Weather?").content == "hi"  # nothing of the refused call was kept


def test_usage_counts_a_required_calls_forced_head_as_answer_not_prompt(scripted_llm):
    llm, _ = scripted_llm(CALL, 'Porto"}}</tool_call>')
    question = [HumanMessage("Weather?")]
    chosen = llm.bind_tools([get_weather]).invoke(question)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    assert forced.tool_calls[0]["args"] == chosen.tool_calls[0]["args"] == {"city": "Porto"}
    # the same messages: the same prompt, however much of the answer was given
    assert forced.usage_metadata["input_tokens"] == chosen.usage_metadata["input_tokens"]
    # the same call text: the same count, but for where the forced head's last token splits it
    assert abs(forced.usage_metadata["output_tokens"] - chosen.usage_metadata["output_tokens"]) <= 1
    assert forced.usage_metadata["input_token_details"]["cache_read"] <= forced.usage_metadata["input_tokens"]


def test_a_stop_string_in_a_required_calls_forced_head_stops_nothing(scripted_llm):
    # the engine matches stop strings in what the model writes; the head was given to it
    llm, _ = scripted_llm('Faro"}}</tool_call>')
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?", stop=["{", "get_weather"])
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Faro"})]


@pytest.mark.parametrize("as_text", [True, False])
def test_a_reply_whose_only_call_names_no_bound_tool_keeps_it_as_text_where_asked(tiny_model, tiny_tok, as_text):
    # clm serve asks (OpenAI's schema has no invalid_tool_calls); ChatCLM hands them over parsed
    from clm_middleware.adapters.chat_call import ChatCall, ChatRequest
    from clm_middleware.adapters.messages import to_turn
    from clm_middleware.adapters.sessions import SessionRouter
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine
    from clm_middleware.lifecycle.config import GenerationSettings
    from clm_middleware.models import ScriptedReplies

    invented = '<tool_call>{"name": "get_sunny", "arguments": {}}</tool_call>'
    script = ScriptedReplies([[*tiny_tok.encode(invented, add_special_tokens=False), tiny_tok.eos_token_id]])
    engine = Engine(tiny_model, tiny_tok, logits_processors=[script])
    router = SessionRouter(lambda cid: Conversation(engine, conversation_id=cid, tagging="signals"))
    request = ChatRequest(
        turns=[to_turn(HumanMessage("Weather in Porto?"))],
        settings=GenerationSettings(max_new_tokens=64),
        tools=[convert_to_openai_tool(get_weather)],
        invalid_calls_as_text=as_text,
    )
    call = ChatCall(router, engine, request)
    streamed = "".join(call.stream())
    answer = call.answer
    assert not answer.tool_calls and answer.invalid_tool_calls[0]["name"] == "get_sunny"
    assert answer.finish_reason == "stop"
    assert streamed == answer.content == (invented if as_text else "")
    # "empty" says what the client got: the call as text is not an empty reply
    assert ("empty" in answer.reply.stats.reply_flags) is (not as_text)
    # the history sent back with the content as returned extends the same conversation
    again = ChatRequest(
        turns=[
            to_turn(m, i)
            for i, m in enumerate([HumanMessage("Weather in Porto?"), AIMessage(answer.content), HumanMessage("And?")])
        ],
        settings=GenerationSettings(max_new_tokens=1),
        tools=[convert_to_openai_tool(get_weather)],
        invalid_calls_as_text=as_text,
    )
    follow = ChatCall(router, engine, again)
    list(follow.stream())
    assert follow.answer.route == "extend"


def test_a_required_call_to_a_tool_with_defs_in_its_parameters_is_written_under_its_grammar(scripted_llm):
    # pydantic and the openai SDK put nested models under "$defs"; nested under the call's
    # "arguments", "#/$defs/Address" had pointed nowhere, and the call went unconstrained
    from clm_middleware.adapters.chat_call import tool_call_format

    llm, _ = scripted_llm("unused")
    parameters = {
        "type": "object",
        "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"],
    }
    spec = {"type": "function", "function": {"name": "ship", "description": "Ship it.", "parameters": parameters}}
    assert tool_call_format(llm.engine, "ship", [spec]) is not None


def test_a_required_call_to_a_tool_whose_only_parameter_schema_is_true_is_made(scripted_llm):
    llm, _ = scripted_llm('"anything"}}</tool_call>')
    spec = {
        "type": "function",
        "function": {"name": "echo", "parameters": {"type": "object", "properties": {"x": True}}},
    }
    message = llm.bind(tools=[spec], tool_choice="echo").invoke("Echo.")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("echo", {"x": "anything"})]


def test_a_tool_call_that_repeats_an_earlier_one_stays_in_the_context(scripted_llm):
    # an agent polling a tool calls it again; dropped as a repeated reply, the result the
    # client sends next had followed no call
    llm, _ = scripted_llm(CALL, "It is sunny.", CALL)
    agent = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Porto?")
    call = agent.invoke([question])
    result = get_weather.invoke(call.tool_calls[0])
    answer = agent.invoke([question, call, result])
    again = agent.invoke([question, call, result, answer, HumanMessage("And now?")])
    assert [(c["name"], c["args"]) for c in again.tool_calls] == [("get_weather", {"city": "Porto"})]
    assert again.response_metadata["lifecycle"]["dropped_tokens"] == 0
    (session,) = next(iter(llm._routers.values())).sessions()
    assert session.conversation.context.count(CALL) == 2


def test_an_answer_to_a_tool_result_that_repeats_an_earlier_answer_stays_in_the_context(scripted_llm):
    """Dropped as a repeat, an agent's context held calls and results alone, and the model
    answered the next result with the same call again (a helper's loop at budget 512)."""
    answer = "It is sunny there, with a light breeze and clear skies all day."
    llm, _ = scripted_llm(CALL, answer, CALL, answer)
    agent = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Porto?")
    call = agent.invoke([question])
    result = get_weather.invoke(call.tool_calls[0])
    first = agent.invoke([question, call, result])
    again = HumanMessage("And in Porto again?")
    second_call = agent.invoke([question, call, result, first, again])
    second_result = get_weather.invoke(second_call.tool_calls[0])
    second = agent.invoke([question, call, result, first, again, second_call, second_result])
    assert second.content == answer
    assert "repeats_earlier_reply" in second.response_metadata["lifecycle"]["reply_flags"]
    assert second.response_metadata["lifecycle"]["dropped_tokens"] == 0
    (session,) = next(iter(llm._routers.values())).sessions()
    assert session.conversation.context.count(answer) == 2


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "string[]"),
        ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "(integer | null)[]"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
            "{a: string, b?: integer}",
        ),
        ({"$ref": "#/$defs/P"}, "{name: string}"),
        ({"enum": ["one_way", "round_trip"]}, '"one_way" | "round_trip"'),
        ({"type": "object"}, "object"),
        ({}, "any"),
    ],
)
def test_a_parameter_type_is_a_short_expression_never_schema_keywords(spec, text):
    """SmolLM2 shown '{"items": {"type": "string"}, "type": "array"}' for a list wrote
    ["items", "type", "array", ...] as its value (a helper's agent sweep)."""
    from clm_middleware.adapters.tools import type_text

    root = {"$defs": {"P": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
    assert type_text(spec, root) == text


def test_response_metadata_says_what_the_lifecycle_did_this_turn(scripted_llm):
    llm, _ = scripted_llm("Hello.")
    lifecycle = llm.invoke("Hi").response_metadata["lifecycle"]
    assert {"compaction", "restored", "reply_flags", "decisions", "context_tokens"} <= set(lifecycle)
    assert lifecycle["restored"] == [] and isinstance(lifecycle["reply_flags"], list)
