"""``ResponseFormat``: every spelling of OpenAI's and LangChain's response formats, and clear errors."""

from __future__ import annotations

import pytest

from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.structured import ResponseFormat

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, ResponseFormat()),
        ({"type": "json_mode"}, ResponseFormat()),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}, "p"),
        ({"type": "json_schema", "schema": SCHEMA}, None),
    ],
)
def test_openai_and_langchain_spellings_parse(value, expected):
    fmt = ResponseFormat.parse(value)
    if isinstance(expected, ResponseFormat) or value is None or value == {"type": "text"}:
        assert fmt == expected
    else:
        assert fmt.schema == SCHEMA and fmt.name == expected


def test_the_schema_keeps_its_key_order():
    assert list(ResponseFormat.from_schema(SCHEMA).schema["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    "value,field",
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "schema": {"properties": {"a": {"type": "strng"}}}},
            "response_format.schema",
        ),
        ({"type": "json_schema", "schema": {"type": [{}]}}, "response_format.schema"),
        ({"type": "json_schema", "schema": {"const": float("nan")}}, "response_format.schema"),
    ],
)
def test_a_bad_format_is_a_config_error_naming_the_field(value, field):
    with pytest.raises(ConfigError) as error:
        ResponseFormat.parse(value)
    assert error.value.field == field


def test_a_property_named_type_is_not_mistaken_for_the_keyword():
    schema = {"type": "object", "properties": {"type": {"type": "string"}}}
    assert ResponseFormat.from_schema(schema).schema == schema


def test_generation_settings_read_a_dict_as_a_response_format():
    settings = GenerationSettings(response_format={"type": "json_object"})
    assert settings.response_format == ResponseFormat.json_object()
    with pytest.raises(ConfigError, match=r"response_format\.type"):
        GenerationSettings(response_format={"type": "yaml"})
