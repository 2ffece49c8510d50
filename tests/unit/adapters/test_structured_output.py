"""``ChatCLM.with_structured_output`` and ``bind(response_format=...)`` under a JSON grammar."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import ToolMessage
from pydantic import BaseModel, Field

from clm_middleware.adapters import ChatCLM
from clm_middleware.engine import Engine


class Person(BaseModel):
    """Short by construction (bounded string and integer), so any model completes one."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=130)


PERSON_SCHEMA = Person.model_json_schema()


@pytest.fixture
def random_llm(tiny_model, tiny_tok):
    """The tiny random Llama, unscripted: left alone it writes bytes, not JSON."""
    engine = Engine(tiny_model, tiny_tok)
    return ChatCLM(engine=engine, tagging="signals", max_tokens=120, temperature=1.0, seed=4)


def test_json_mode_needs_no_schema_and_returns_a_dict(scripted_llm):
    llm, _ = scripted_llm('"setup": "Why?", "punchline": "Because."}')  # "{" is forced
    joke = llm.with_structured_output(None, method="json_mode").invoke("Tell me a joke as JSON.")
    assert joke == {"setup": "Why?", "punchline": "Because."}


def test_json_schema_makes_the_reply_valid_where_the_model_writes_invalid_json(scripted_llm):
    """The issue's reply, ``{name: "Ana", age: 34}`` (keys unquoted): the grammar forces
    the quotes; what the model was going to say fills in where the grammar lets it."""
    llm, _ = scripted_llm('name: "Ana", age: 34}')
    result = llm.with_structured_output(Person, method="json_schema", include_raw=True).invoke("Ana is 34.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], Person)
    assert list(json.loads(result["raw"].content)) == ["name", "age"]


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_a_stop_string_inside_a_structured_reply_does_not_cut_its_document(scripted_llm, method):
    """The grammar ends the reply with its document: stop=["Ana"] had cut '{"name": "'
    and LangChain's parser read a Person with an empty name, or no call at all."""
    reply = '"name": "Ana", "age": 34}' + ("}</tool_call>" if method == "function_calling" else "")
    llm, _ = scripted_llm(reply, stop=["Ana"])
    schema = None if method == "json_mode" else Person
    result = llm.with_structured_output(schema, method=method).invoke("Ana is 34.")
    assert (result if method == "json_mode" else result.model_dump()) == {"name": "Ana", "age": 34}


@pytest.mark.parametrize(
    ("schema", "reply", "expected"),
    [
        ({"title": "Names", "type": "array", "items": {"type": "string"}}, '["Ana", "Bo"]', ["Ana", "Bo"]),
        ({"type": "string", "enum": ["red", "green"]}, '"green"', "green"),
        ({"title": "Colour", "enum": ["red", "green"]}, '"red"', "red"),
        # an OpenAI tool is no schema: its parameters are (as before the roots above were read)
        (
            {"type": "function", "function": {"name": "pet", "parameters": {"type": "object", "properties": {}}}},
            "}",
            {},
        ),
    ],
)
def test_a_json_schema_dict_whose_root_is_no_object_constrains_and_parses(scripted_llm, schema, reply, expected):
    # convert_to_json_schema had kept the title alone: "not a JSON schema", though it names a type
    llm, _ = scripted_llm(reply)
    assert llm.with_structured_output(schema, method="json_schema").invoke("Names?") == expected


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_a_random_model_answers_with_parseable_structured_output(random_llm, method):
    structured = random_llm.with_structured_output(Person if method == "json_schema" else None, method=method)
    result = structured.invoke("Describe Ana, 34, as JSON.", max_tokens=120 if method == "json_schema" else 400)
    if method == "json_schema":
        assert isinstance(result, Person) and len(result.name) <= 8 and 0 <= result.age <= 130
    else:
        assert isinstance(result, dict)


def test_bind_response_format_in_openai_form_constrains_invoke_and_stream(random_llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    bound = random_llm.bind(response_format=fmt)
    message = bound.invoke("Ana, 34, as JSON.")
    assert message.response_metadata["finish_reason"] == "stop"
    assert Person.model_validate_json(message.content)
    streamed = "".join(chunk.content for chunk in bound.stream("Bruno, 51, as JSON."))
    assert Person.model_validate_json(streamed)


def test_a_reply_cut_by_max_tokens_reports_length(random_llm):
    fmt = {"type": "json_schema", "schema": PERSON_SCHEMA}  # two required keys: more than 3 tokens
    message = random_llm.bind(response_format=fmt).invoke("JSON.", max_tokens=3)
    assert message.response_metadata["finish_reason"] == "length" and message.content.startswith("{")


def test_a_method_that_needs_a_schema_says_so(random_llm):
    with pytest.raises(ValueError, match="json_mode works without one"):
        random_llm.with_structured_output(None, method="json_schema")


def test_a_bad_bound_response_format_names_the_field(random_llm):
    with pytest.raises(ValueError, match=r"response_format\.type"):
        random_llm.bind(response_format={"type": "yaml"}).invoke("hi")


@pytest.mark.parametrize(
    ("method", "script"),
    [
        ("json_schema", '"name": "Ana", "age": 34}'),  # the opening "{" is forced
        ("function_calling", '"name": "Ana", "age": 34}}</tool_call>'),  # the call head and "{" are forced
    ],
)
def test_a_structured_reply_cut_by_max_tokens_fails_to_parse_instead_of_completing_wrongly(
    scripted_llm, method, script
):
    """Cut inside ``34``, the JSON reads ``"age": 3``: LangChain's parsers would close it
    into a valid, wrong Person. It is a parsing error, as the openai SDK's parse() raises;
    only a call cut in its closing tag, its object written whole, parses (rightly)."""
    llm, _ = scripted_llm(script)
    full = llm.with_structured_output(Person, method=method, include_raw=True).invoke("Ana is 34.")
    assert full["parsed"] == Person(name="Ana", age=34) and full["parsing_error"] is None
    reply_tokens = full["raw"].usage_metadata["output_tokens"]
    parsed = []
    for cut in range(1, reply_tokens - 1):  # the last two: the closing "}" (or tag) and the end of turn
        llm, _ = scripted_llm(script, max_tokens=cut)
        result = llm.with_structured_output(Person, method=method, include_raw=True).invoke("Ana is 34.")
        if result["parsed"] is not None:
            assert result["parsed"] == Person(name="Ana", age=34) and method == "function_calling"
            parsed.append(cut)
            continue
        assert result["raw"].response_metadata["finish_reason"] == "length"
        assert "max_tokens" in str(result["parsing_error"])
    assert parsed == list(range(reply_tokens - 1 - len(parsed), reply_tokens - 1))  # only the tag's tokens


@pytest.mark.parametrize(
    "wrap",
    [
        lambda schema: {"name": "Person", "schema": schema, "strict": True},
        lambda schema: {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}},
    ],
    ids=["name-schema", "response_format"],
)
def test_a_schema_in_openais_response_format_spelling_constrains_the_reply(scripted_llm, wrap):
    """ChatOpenAI accepts these dicts; code ported from it passes them."""
    llm, _ = scripted_llm('"name": "Ana", "age": 34}')
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    assert llm.with_structured_output(wrap(schema), method="json_schema").invoke("Ana is 34.") == {
        "name": "Ana",
        "age": 34,
    }


def test_a_dict_that_is_no_json_schema_is_refused_instead_of_constraining_nothing(random_llm):
    with pytest.raises(ValueError, match=r"schema: .* is not a JSON schema"):
        random_llm.with_structured_output({"title": "Person"}, method="json_schema")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'


def test_with_tools_the_model_may_call_one_instead_of_answering_in_the_format(scripted_llm):
    """OpenAI's tools beside a response_format (tool_choice auto), as an agent with a typed
    final answer sends them: the grammar allows a call of a bound tool or the document."""
    llm, script = scripted_llm(CALL, '{"name": "Ana", "age": 34}')
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    agent = llm.bind_tools([WEATHER_TOOL]).bind(response_format=fmt)
    call = agent.invoke("Where does Ana live, and how old is she?")
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Porto"})]
    assert call.response_metadata["finish_reason"] == "tool_calls"
    answer = agent.invoke(
        ["Where does Ana live, and how old is she?", call, ToolMessage("Sunny.", tool_call_id=call.tool_calls[0]["id"])]
    )
    assert json.loads(answer.content) == {"name": "Ana", "age": 34} and not answer.tool_calls
    assert script.remaining == 0


def test_with_tools_a_reply_that_is_neither_a_call_nor_the_document_is_kept_out(scripted_llm):
    # the script's free text is not allowed: the grammar leads it into a call or a document
    llm, _ = scripted_llm("Sure! Ana is 34.")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    message = llm.bind_tools([WEATHER_TOOL]).bind(response_format=fmt).invoke("Ana is 34.", max_tokens=120)
    if message.tool_calls:
        assert message.tool_calls[0]["name"] == "get_weather" and isinstance(message.tool_calls[0]["args"]["city"], str)
    else:
        Person.model_validate_json(message.content)


def test_a_required_call_leaves_the_json_instruction_out_of_the_prompt(scripted_llm):
    # the call wins over the format, so the system message must not ask for a JSON answer
    llm, _ = scripted_llm('Porto"}}</tool_call>')  # the call head is forced up to the string's quote
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="required").bind(response_format=fmt).invoke("Weather?")
    assert message.tool_calls[0]["args"] == {"city": "Porto"}
    conversation = llm.conversation(message.response_metadata["conversation_id"])
    assert "get_weather" in conversation.tools_prompt and "JSON object" not in conversation.tools_prompt


def test_the_instruction_shows_the_schemas_shape_and_descriptions_not_its_keywords():
    from clm_middleware.adapters.chat_call import shape_text
    from clm_middleware.structured import ResponseFormat

    class Order(BaseModel):
        """An order."""

        item: str = Field(description="What was ordered")
        tags: list[str] = []

    text = shape_text(ResponseFormat.from_schema(Order.model_json_schema()))
    assert text.startswith(" Its shape: {item: string, tags?: string[]} (An order.)")
    assert "\n    item: What was ordered" in text and '"type"' not in text and "items" not in text


def test_the_instruction_names_the_roots_kind_and_adds_no_empty_description(engine):
    from clm_middleware.adapters.chat_call import system_sections
    from clm_middleware.structured import ResponseFormat

    names = system_sections(engine, [], ResponseFormat.from_schema({"type": "array", "items": {"type": "string"}}))
    assert names == "Respond with a single JSON value and nothing else. Its shape: string[]"

    class Pet(BaseModel):  # no docstring: pydantic writes no description, a TypedDict an empty one
        name: str

    pet = system_sections(engine, [], ResponseFormat.from_schema({**Pet.model_json_schema(), "description": ""}))
    assert pet == "Respond with a single JSON object and nothing else. Its shape: {name: string}"
