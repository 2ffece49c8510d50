"""Grammar-constrained JSON on the tiny random Llama: valid by construction, whatever the model.

A random model is the hardest client a grammar can have: left alone it writes bytes.
Every document these tests decode must parse with ``json.loads`` and match its schema;
``finish_reason == "length"`` is the one way out, and then the text is unfinished.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from clm_middleware.errors import ConfigError
from clm_middleware.structured import ResponseFormat
from clm_middleware.structured.format import LONGEST_NUMBER
from clm_middleware.structured.grammar import compiler_for

# every document of this schema is short, so a reply always completes within the budget
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver"]},
    },
    "required": ["name", "age", "member"],
}
BUDGET = 160  # byte tokens: a 6-character string can take 36 (\uXXXX escapes), the rest < 60


def matches_person(document: object) -> None:
    """The checks jsonschema would make for PERSON (keys, types, ranges, enum)."""
    assert isinstance(document, dict)
    assert {"name", "age", "member"} <= set(document) <= set(PERSON["properties"])
    assert isinstance(document["name"], str) and len(document["name"]) <= 6
    assert type(document["age"]) is int and 0 <= document["age"] <= 120
    assert type(document["member"]) is bool
    assert document.get("tier", "gold") in ("gold", "silver")


def respond(conversation, fmt, **settings):
    conversation.add("user", "Describe a customer as JSON.")
    turn_settings = dataclasses.replace(conversation.generation, response_format=fmt, **settings)
    return conversation.respond(settings=turn_settings)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.3, 3)])
def test_a_random_model_under_a_schema_writes_a_document_that_validates(converse, temperature, seed):
    conversation = converse(max_new_tokens=BUDGET, temperature=temperature, seed=seed)
    reply = respond(conversation, ResponseFormat.from_schema(PERSON))
    assert reply.finish_reason == "stop"
    matches_person(json.loads(reply.text))
    assert list(json.loads(reply.text))[:2] == ["name", "age"]  # the schema's order


def test_properties_come_in_the_schema_order_and_the_layout_is_json_dumps(converse):
    conversation = converse(max_new_tokens=BUDGET, temperature=1.0, seed=5)
    reply = respond(conversation, ResponseFormat.from_schema(PERSON))
    assert reply.text == json.dumps(json.loads(reply.text), ensure_ascii=False)


def test_json_mode_without_a_schema_gives_a_json_object(converse):
    """Any JSON object: sampled replies that end on their own all parse as objects."""
    finished = []
    for seed in range(6):
        conversation = converse(max_new_tokens=96, temperature=1.0, seed=seed)
        reply = respond(conversation, ResponseFormat.json_object())
        assert reply.text.startswith("{")
        if reply.finish_reason == "stop":
            finished.append(json.loads(reply.text))
    assert finished and all(isinstance(document, dict) for document in finished)


def test_a_reply_prefix_is_part_of_the_document(converse):
    conversation = converse(max_new_tokens=BUDGET, temperature=1.0, seed=7)
    conversation.add("user", "JSON please.")
    settings = dataclasses.replace(conversation.generation, response_format=ResponseFormat.from_schema(PERSON))
    reply = conversation.respond(reply_prefix='{"name": "Ana', settings=settings)
    assert reply.text.startswith('{"name": "Ana')
    matches_person(json.loads(reply.text))


def test_a_reply_prefix_the_grammar_cannot_continue_is_a_config_error(converse):
    conversation = converse()
    conversation.add("user", "JSON please.")
    settings = dataclasses.replace(conversation.generation, response_format=ResponseFormat.json_object())
    with pytest.raises(ConfigError, match="reply_prefix"):
        conversation.respond(reply_prefix="Sure! ", settings=settings)
    assert conversation.turn == 0 and conversation.respond().turn == 1  # nothing of the failed turn stayed


def test_running_out_of_tokens_mid_document_finishes_with_length(converse):
    conversation = converse(max_new_tokens=5, temperature=1.0, seed=1)
    reply = respond(conversation, ResponseFormat.from_schema(PERSON))
    assert reply.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.text)


def test_a_schema_the_grammar_rejects_fails_before_the_turn_starts(converse):
    conversation = converse()
    broken = ResponseFormat.from_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(ConfigError, match=r"response_format\.json_schema\.schema: cannot be used") as error:
        respond(conversation, broken)
    assert error.value.field == "response_format.json_schema.schema"
    assert conversation.turn == 0


def test_penalties_only_reorder_what_the_grammar_allows(converse):
    """A strict n-gram ban next to a grammar: the ban yields where it would leave nothing."""
    conversation = converse(max_new_tokens=BUDGET, temperature=0.0, no_repeat_ngram_size=1, repetition_penalty=1.3)
    reply = respond(conversation, ResponseFormat.from_schema(PERSON))
    matches_person(json.loads(reply.text))


def test_the_stop_token_is_allowed_only_once_the_document_is_complete(engine, tiny_tok):
    compiler = compiler_for(engine)
    eos, im_start = tiny_tok.eos_token_id, tiny_tok.convert_tokens_to_ids("<|im_start|>")
    inside = compiler.constraint(ResponseFormat.json_object(), tiny_tok.encode('{"a": "x', add_special_tokens=False))
    allowed = inside.allowed()
    assert not allowed[eos] and not allowed[im_start]  # a special token never enters a string
    [letter, quote] = tiny_tok.encode('y"', add_special_tokens=False)
    assert allowed[letter] and allowed[quote]
    done = compiler.constraint(ResponseFormat.json_object(), tiny_tok.encode('{"a": 1}', add_special_tokens=False))
    assert done.complete
    assert done.allowed().nonzero().flatten().tolist() == [eos]


def test_the_compiler_is_built_once_per_engine_and_caches_grammars(engine, make_engine):
    compiler = compiler_for(engine)
    assert compiler_for(engine) is compiler
    assert compiler_for(make_engine()) is not compiler
    fmt = ResponseFormat.from_schema(PERSON)
    assert compiler.compile(fmt) is compiler.compile(ResponseFormat.from_schema(PERSON, name="other"))


def test_a_conversation_keeps_its_response_format_through_the_store(converse, engine, tmp_path):
    from clm_middleware.conversation import Conversation

    fmt = ResponseFormat.from_schema(PERSON, name="person")
    conversation = converse(store=tmp_path / "c.db", conversation_id="p", response_format=fmt.as_openai())
    conversation.send("Hi")
    conversation.close()
    loaded = Conversation.load(tmp_path / "c.db", "p", engine, max_new_tokens=BUDGET, temperature=1.0, seed=2)
    assert loaded.generation.response_format == fmt
    matches_person(json.loads(loaded.send("A customer, as JSON.").text))


JOKE = {
    "type": "object",
    "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
    "required": ["setup", "punchline"],
}


def scripted_document(scripted, looping: str, schema: dict):
    """The reply of a model scripted to write ``looping`` (a document's start, "{" given
    as the reply prefix) under ``schema``, with tokens to spare."""
    from clm_middleware.conversation import Conversation

    engine, _ = scripted(looping[1:])
    conversation = Conversation(engine, tagging="signals", max_new_tokens=len(looping) + 40)
    conversation.add("user", "As JSON, please.")
    settings = dataclasses.replace(conversation.generation, response_format=ResponseFormat.from_schema(schema))
    return conversation.respond(reply_prefix="{", settings=settings)


def test_a_loop_inside_a_string_value_is_closed_and_the_document_finishes(scripted):
    """What SmolLM2 does with a joke schema: it repeats a clause inside "setup" until the
    tokens run out. Under a grammar the reply cannot be cut, so the string is closed
    instead, and the rest of the document follows."""
    reply = scripted_document(scripted, '{"setup": "' + "the cat was a cat, and " * 12, JOKE)
    joke = json.loads(reply.text)
    assert reply.finish_reason == "stop" and set(joke) == {"setup", "punchline"}
    assert joke["setup"].count("the cat was a cat") <= 3  # closed at the first repeat, not after twelve
    assert "string_loop_closed" in reply.stats.reply_flags


def test_a_phrase_loop_with_no_sentence_mark_inside_a_string_is_closed(scripted):
    """SmolLM2 on a movie schema: '{"title": "The movie The movie The movie ...' until
    max_tokens, a loop no sentence or clause mark bounds (a helper's probe)."""
    reply = scripted_document(scripted, '{"setup": "' + "The movie " * 16, JOKE)
    joke = json.loads(reply.text)
    assert reply.finish_reason == "stop" and set(joke) == {"setup", "punchline"}
    assert joke["setup"].count("The movie") <= 3
    assert reply.stats.reply_flags.count("string_loop_closed") == 1


def test_phrase_loop_in_string_needs_a_phrase_said_three_times_running_over_six_words():
    from clm_middleware.structured.format import phrase_loop_in_string

    assert phrase_loop_in_string('{"title": "The movie The movie The movie')
    assert phrase_loop_in_string('{"a": "x", "b": "Ha ha ha ha HA ha')
    assert phrase_loop_in_string(
        '{"t": "we went to the park and then we went to the park and then we went to the park and then'
    )
    assert not phrase_loop_in_string('{"title": "The movie The movie')  # twice
    assert not phrase_loop_in_string('{"t": "It was very very very good')  # a phrase of three words
    assert not phrase_loop_in_string('{"t": "The movie The movie The movie"')  # the string has ended
    assert not phrase_loop_in_string('{"t": "a", "u": ["one two", "one two", "one two"')  # three strings, not one


def test_inside_string_follows_quotes_and_escapes():
    from clm_middleware.structured.format import inside_string

    assert inside_string('{"a": "x')
    assert not inside_string('{"a": "x"')
    assert inside_string('{"a": "say \\"hi')
    assert not inside_string('{"a": "c:\\\\"')


def test_two_looping_strings_are_both_closed_and_flagged_once(scripted):
    looping = '{"setup": "' + "the cat was a cat, and " * 8 + '", "punchline": "' + "so the dog ran, and " * 8
    reply = scripted_document(scripted, looping, JOKE)
    joke = json.loads(reply.text)
    assert reply.finish_reason == "stop" and joke["punchline"].count("so the dog ran") <= 3
    assert reply.stats.reply_flags.count("string_loop_closed") == 1


def test_a_digit_loop_is_closed_and_the_document_finishes(scripted):
    """What SmolLM2 wrote for an integer property: digits until the tokens ran out."""
    schema = {
        "type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"type": "string", "maxLength": 4}},  # the script ends at b
        "required": ["b", "a"],
    }
    reply = scripted_document(scripted, '{"b": ' + "3" * 60, schema)
    document = json.loads(reply.text)
    assert reply.finish_reason == "stop" and set(document) == {"a", "b"}
    assert len(str(document["b"])) <= LONGEST_NUMBER + 4  # closed at the bound, give or take a token
    assert reply.stats.reply_flags.count("number_loop_closed") == 1


def test_a_digit_cycle_inside_a_string_is_closed_and_the_document_finishes(scripted):
    """SmolLM2 on a required tool call: "user_id": "1234567890123..." until max_tokens."""
    schema = {
        "type": "object",
        "properties": {"user_id": {"type": "string"}, "a": {"type": "string", "maxLength": 4}},
        "required": ["user_id", "a"],
    }
    reply = scripted_document(scripted, '{"user_id": "' + "1234567890" * 8, schema)
    document = json.loads(reply.text)
    assert reply.finish_reason == "stop" and set(document) == {"user_id", "a"}
    assert len(document["user_id"]) <= LONGEST_NUMBER + 4  # closed at the bound, give or take a token
    assert reply.stats.reply_flags.count("string_loop_closed") == 1


def test_digits_loop_in_string_needs_a_long_run_that_repeats_itself_inside_a_string():
    from clm_middleware.structured.format import digits_loop_in_string

    assert digits_loop_in_string('{"id": "' + "1234567890" * 3)
    assert digits_loop_in_string('{"id": "ab-' + "7" * (LONGEST_NUMBER + 1))
    assert not digits_loop_in_string('{"id": "' + "1234567890" * 2)  # 20 digits: an id may be that long
    assert not digits_loop_in_string('{"id": "' + "31415926535897932384626433832795")  # long, no repeat
    assert not digits_loop_in_string('{"id": ' + "1234567890" * 3)  # a number literal: number_loops's


def test_number_loops_reads_a_long_literal_outside_strings_only():
    from clm_middleware.structured.format import number_loops

    assert number_loops('{"a": -' + "1" * LONGEST_NUMBER)
    assert not number_loops('{"a": -' + "1" * (LONGEST_NUMBER - 2))
    assert not number_loops('{"a": "' + "1" * 60)  # digits inside a string are text
    assert not number_loops('{"a": 1, "b": true')


@pytest.mark.parametrize(
    ("items", "looped"),
    [
        ('"flour", "milk", ' + '"baking time", ' * 20, "baking time"),  # SmolLM2 on a recipe
        ('{"n": "Lao", "a": 25}, ' * 20, {"n": "Lao", "a": 25}),  # the same object again and again
    ],
)
def test_an_array_whose_items_repeat_is_closed_and_the_document_finishes(scripted, items, looped):
    item = {"type": "object", "properties": {"n": {"type": "string"}, "a": {"type": "integer"}}, "required": ["n", "a"]}
    kind = item if isinstance(looped, dict) else {"type": "string"}
    schema = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": kind}, "k": {"type": "string", "maxLength": 3}},
        "required": ["xs", "k"],
    }
    reply = scripted_document(scripted, '{"xs": [' + items, schema)
    document = json.loads(reply.text)
    assert reply.finish_reason == "stop" and document["xs"].count(looped) == 3
    assert reply.stats.reply_flags.count("array_loop_closed") == 1


def test_the_array_watch_ends_only_a_third_copy_of_an_item():
    from clm_middleware.structured.array_watch import ArrayWatch

    def first_close(text: str) -> tuple[str, str] | None:
        watch = ArrayWatch()
        for end in range(1, len(text) + 1):
            if (closer := watch.closing(text[:end])) is not None:
                return text[:end], closer
        return None

    assert first_close('["a", "b", "a", "a"]') == ('["a", "b", "a", "a', '"')
    assert first_close('{"x": [[1, 2], [1, 2], [1, 2]]}') == ('{"x": [[1, 2], [1, 2], [1, 2]', "")
    assert first_close('{"x": [{"k": 1}, {"k": 1}, {"k": 1}]}') == ('{"x": [{"k": 1}, {"k": 1}, {"k": 1', "}")
    for distinct in (
        '["a", "b", "a", "b", "c"]',
        "[3, 3, 3, 3]",
        '["a \\" ]", "a \\" ]", "b"]',
        '{"a": "x", "b": "x", "c": "x"}',
    ):
        assert first_close(distinct) is None, distinct


def test_the_compiled_grammars_kept_are_bounded_least_recently_used_first(engine, monkeypatch):
    from clm_middleware.structured import grammar

    monkeypatch.setattr(grammar, "COMPILED_KEPT", 2)
    compiler = grammar.GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.default_stop_ids)
    formats = [
        ResponseFormat.from_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(3)
    ]
    first, second = compiler.compile(formats[0]), compiler.compile(formats[1])
    assert compiler.compile(formats[0]) is first  # used again: now the most recent
    compiler.compile(formats[2])  # the least recently used (formats[1]) goes
    assert compiler.compile(formats[0]) is first
    assert compiler.compile(formats[1]) is not second  # compiled anew
