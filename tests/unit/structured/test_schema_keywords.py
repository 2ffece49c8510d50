"""Which JSON-schema keywords the grammar enforces: those it would ignore are refused up
front, naming the keyword and where it is; what it enforces once the schema is read as
``keywords.for_grammar`` reads it."""

from __future__ import annotations

import pytest
import xgrammar

from clm_middleware.errors import ConfigError
from clm_middleware.structured import ResponseFormat
from clm_middleware.structured.grammar import compiler_for
from clm_middleware.structured.keywords import for_grammar, nested_at, schema_nodes, without_patterns

INT = {"type": "integer"}
AB = {"type": "object", "properties": {"a": INT, "b": INT}}

# (schema, keyword, where, a document valid without the keyword and invalid with it)
IGNORED = [
    ({"type": "integer", "not": {"const": 3}}, "not", "/", "3"),
    ({**AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if", "/", '{"a": 1}'),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "/", "[1, 1]"),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "contains", "/", "[1]"),
    ({**AB, "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/", '{"a": 1}'),
    ({**AB, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "/", '{"a": 1}'),
    (
        {"allOf": [{**AB, "required": ["a"]}, {**AB, "required": ["b"]}]},
        "allOf",
        "/",
        '{"a": 1}',
    ),
    (
        {"type": "object", "properties": {"tags": {"type": "array", "items": INT, "uniqueItems": True}}},
        "uniqueItems",
        "/properties/tags",
        '{"tags": [2, 2]}',
    ),
]


def accepts(engine, fmt: ResponseFormat, text: str) -> bool:
    """Whether the compiled grammar of ``fmt`` takes ``text`` as a whole document."""
    matcher = xgrammar.GrammarMatcher(compiler_for(engine).compile(fmt))
    return matcher.accept_string(text) and matcher.accept_token(min(engine.default_stop_ids))


@pytest.mark.parametrize("schema,keyword,where,_", IGNORED)
def test_a_keyword_the_grammar_ignores_is_refused_naming_it_and_where_it_is(schema, keyword, where, _):
    with pytest.raises(ConfigError) as error:
        ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert error.value.field == "response_format.json_schema.schema"
    assert repr(keyword) in error.value.problem and f"at {where} " in error.value.problem


@pytest.mark.parametrize("schema,keyword,where,invalid", IGNORED)
def test_the_refused_keywords_are_ones_the_grammar_really_ignores(engine, schema, keyword, where, invalid):
    # the grammar takes a document the schema rejects: were it ever enforced, the refusal could go
    lenient = ResponseFormat.from_schema(schema, enforce_all=False)
    assert accepts(engine, lenient, invalid)


def test_tool_parameters_keep_keywords_the_grammar_ignores():
    """A pydantic ``set`` field (uniqueItems) must not make a tool unusable: the tool checks its arguments."""
    fmt = ResponseFormat.tool_call("tag", {"type": "object", "properties": {"t": IGNORED[2][0]}}, ("<a>", "</a>"))
    assert fmt.schema["properties"]["arguments"]["properties"]["t"]["uniqueItems"] is True


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"not": INT, "if": INT, "contains": INT}},
        {"type": "array", "items": INT, "uniqueItems": False},
        {"allOf": [AB]},
        {**AB, "dependentRequired": {}},
        {"type": "object", "properties": {"a": INT}, "examples": [{"not": 1}]},
    ],
)
def test_names_and_harmless_values_are_not_mistaken_for_ignored_keywords(schema):
    assert ResponseFormat.from_schema(schema).schema == schema


def test_schema_nodes_visits_every_subschema_once_with_its_pointer():
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": {"anyOf": [INT, {"$ref": "#/$defs/n"}]}}},
        "$defs": {"n": {"type": "null"}},
    }
    pointers = [at for at, _ in schema_nodes(schema)]
    items = "/properties/a~1b/items"
    expected = ["", "/properties/a~1b", items, f"{items}/anyOf/0", f"{items}/anyOf/1", "/$defs/n"]
    assert sorted(pointers) == sorted(expected)


def test_a_required_name_the_properties_do_not_list_is_still_required(engine):
    fmt = ResponseFormat.from_schema({"type": "object", "properties": {"a": INT}, "required": ["z"]})
    assert not accepts(engine, fmt, '{"a": 1}')
    assert accepts(engine, fmt, '{"a": 1, "z": "anything"}')


def test_an_unlisted_required_name_takes_the_additional_properties_schema():
    schema = {"type": "object", "properties": {}, "additionalProperties": INT, "required": ["z"]}
    assert for_grammar(schema)["properties"] == {"z": INT}
    assert schema["properties"] == {}  # the argument is not changed


@pytest.mark.parametrize(
    "schema,invalid,valid",
    [
        ({"type": "array", "minItems": 2}, "[1]", '[1, "a"]'),
        ({"type": "object", "minProperties": 1}, "{}", '{"k": 1}'),
    ],
)
def test_a_schema_strict_mode_refuses_compiles_and_is_enforced(engine, schema, invalid, valid):
    fmt = ResponseFormat.from_schema(schema)
    assert not accepts(engine, fmt, invalid)
    assert accepts(engine, fmt, valid)


CHILDREN = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name", "children"],
}


def _call(arguments: str) -> str:
    return f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'


def test_a_tools_own_root_references_point_at_its_arguments_in_the_call_grammar(engine):
    # zod writes "#" for root recursion and "#/properties/a" for a repeated schema; nested
    # under the call's /properties/arguments they had pointed at the call's wrapper
    fmt = ResponseFormat.tool_call("f", CHILDREN, ("<tool_call>", "</tool_call>"))
    assert accepts(engine, fmt, _call('{"name": "x", "children": [{"name": "y", "children": []}]}'))
    assert not accepts(engine, fmt, _call('{"name": "x", "children": [{"name": "f", "arguments": {}}]}'))
    repeated = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"x": INT}}, "b": {"$ref": "#/properties/a"}},
    }
    fmt = ResponseFormat.tool_call("f", repeated, ("<tool_call>", "</tool_call>"))
    assert accepts(engine, fmt, _call('{"a": {"x": 1}, "b": {"x": 2}}'))


def test_nested_at_reads_draft4_bounds_and_an_integers_fractional_bounds_and_keeps_definitions_refs():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": False},
            "k": {"type": "integer", "minimum": 0.5, "maximum": 7.9},
            "d": {"$ref": "#/$defs/D"},
        },
        "$defs": {"D": {"$ref": "#/properties/k"}},
    }
    nested = nested_at(schema, "/properties/arguments")
    assert nested["properties"]["n"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 9}
    assert nested["properties"]["k"] == {"type": "integer", "minimum": 1, "maximum": 7}
    assert nested["properties"]["d"] == {"$ref": "#/$defs/D"}  # definitions move to the call's root
    assert nested["$defs"]["D"] == {"$ref": "#/properties/arguments/properties/k"}
    assert schema["properties"]["n"]["exclusiveMinimum"] is True  # the argument is left as it was


def test_without_patterns_drops_the_keyword_not_a_property_called_pattern():
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "^\\p{L}+$"}}}
    assert without_patterns(schema) == {"type": "object", "properties": {"pattern": {"type": "string"}}}
    assert schema["properties"]["pattern"]["pattern"] == "^\\p{L}+$"


@pytest.mark.parametrize(
    ("bounds", "whole"),
    [
        ({"type": "integer", "minimum": 0.5, "exclusiveMinimum": True}, {"minimum": 1}),  # draft 4, then rounded
        ({"type": "integer", "exclusiveMinimum": 0.5}, {"minimum": 1}),
        ({"type": "integer", "maximum": 2.5, "exclusiveMaximum": True}, {"maximum": 2}),
        ({"type": ["integer", "null"], "minimum": 0.5}, {"minimum": 1}),
        ({"type": "integer", "exclusiveMinimum": 0.5, "minimum": 3}, {"minimum": 3}),  # the tighter bound
        ({"type": ["integer", "number"], "minimum": 0.5}, {"minimum": 0.5}),  # fractions admitted: as it is
    ],
)
def test_an_integers_fractional_bounds_become_the_whole_numbers_they_admit(bounds, whole):
    kind = {"type": bounds["type"]}
    assert nested_at({"properties": {"a": bounds}}, "/x")["properties"]["a"] == {**kind, **whole}


def test_a_percent_encoded_reference_into_the_definitions_is_kept_as_they_move(engine):
    schema = {"type": "object", "properties": {"c": {"$ref": "#/%24defs/A"}}, "$defs": {"A": {"type": "string"}}}
    fmt = ResponseFormat.tool_call("f", schema, ("<tool_call>", "</tool_call>"))
    assert accepts(engine, fmt, _call('{"c": "x"}')) and not accepts(engine, fmt, _call('{"c": 1}'))
