"""Transcript readers: every format detected and read, tool calls kept, errors located."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clm_middleware.errors import TranscriptError
from clm_middleware.replay.formats import read_transcripts


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_openai_list_object_and_many_conversations_with_tool_calls(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    [single] = read_transcripts(write(tmp_path, "a.json", messages))
    assert [m.role for m in single.messages] == ["user", "assistant", "tool"]
    assert single.messages[1].tool_calls[0]["function"]["name"] == "lookup"
    assert single.messages[2].tool_call_id == "c1"
    [wrapped] = read_transcripts(write(tmp_path, "b.json", {"messages": messages}))
    assert len(wrapped.messages) == 3
    many = read_transcripts(
        write(tmp_path, "c.json", [{"id": "x", "messages": messages}, {"id": "y", "traj": messages}])
    )
    assert [t.conversation_id for t in many] == ["c-x", "c-y"]


def test_sharegpt_one_or_many_with_speaker_names_mapped(tmp_path):
    one = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "h"},
            {"from": "gpt", "value": "g"},
        ]
    }
    [transcript] = read_transcripts(write(tmp_path, "s.json", one))
    assert [m.role for m in transcript.messages] == ["system", "user", "assistant"]
    assert len(read_transcripts(write(tmp_path, "m.json", [one, one]))) == 2
    calls = {
        "conversations": [
            {"from": "human", "value": "h"},
            {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
            {"from": "observation", "value": "ok"},
        ]
    }
    [with_calls] = read_transcripts(write(tmp_path, "f.json", calls))
    assert with_calls.messages[1].tool_calls == ({"name": "f", "arguments": {}},)
    assert with_calls.messages[2].role == "tool"


def test_langchain_message_dicts(tmp_path):
    dumped = [
        {"type": "system", "data": {"content": "s"}},
        {"type": "human", "data": {"content": "h"}},
        {"type": "ai", "data": {"content": "", "tool_calls": [{"name": "f", "args": {"a": 1}, "id": "i"}]}},
    ]
    [transcript] = read_transcripts(write(tmp_path, "lc.json", {"messages": dumped}))
    assert [m.role for m in transcript.messages] == ["system", "user", "assistant"]
    assert transcript.messages[2].tool_calls[0]["arguments"] == {"a": 1}


def test_jsonl_with_another_extension_is_still_read(tmp_path):
    text = '{"role": "user", "content": "a"}\n{"role": "assistant", "content": "b"}\n'
    [transcript] = read_transcripts(write(tmp_path, "chat.txt", text))
    assert len(transcript.messages) == 2


def test_a_jsonl_file_of_whole_conversations_is_read_one_conversation_per_line(tmp_path):
    """How datasets ship: ShareGPT, OpenAI fine-tuning and LangChain conversations, one per
    line; a line without an id is named by its line."""
    sharegpt = {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}
    openai = {"id": "t7", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    langchain = {"messages": [{"type": "human", "data": {"content": "x"}}, {"type": "ai", "data": {"content": "y"}}]}
    text = "\n".join(json.dumps(line) for line in (sharegpt, openai, langchain, sharegpt)) + "\n"
    for fmt in ("auto", "jsonl"):
        read = read_transcripts(write(tmp_path, "data.jsonl", text), fmt)
        assert [t.conversation_id for t in read] == ["data-1", "data-t7", "data-3", "data-4"]
        assert [[m.role for m in t.messages] for t in read] == [["user", "assistant"]] * 4
    [only] = read_transcripts(write(tmp_path, "one.jsonl", json.dumps(sharegpt) + "\n"), "sharegpt")
    assert only.messages[1].content == "g"


def test_a_bad_conversation_line_is_named_by_its_line_or_skipped(tmp_path):
    good = json.dumps({"conversations": [{"from": "human", "value": "h"}]})
    bad = json.dumps({"conversations": [{"from": "robot", "value": "x"}]})
    path = write(tmp_path, "lines.jsonl", f"{good}\n{bad}\n")
    with pytest.raises(TranscriptError, match=r"lines\.jsonl:2: .*unknown speaker 'robot'"):
        read_transcripts(path)
    skipped: list[TranscriptError] = []
    assert len(read_transcripts(path, skipped=skipped)) == 1 and skipped[0].line == 2


def test_a_message_without_a_role_says_so(tmp_path):
    with pytest.raises(TranscriptError, match=r'x\.jsonl:1: a message needs a "role"'):
        read_transcripts(write(tmp_path, "x.jsonl", '{"content": "hi"}\n'))


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("bad.json", "{broken", r"bad\.json:1: not valid JSON"),
        (
            "who.json",
            {"conversations": [{"from": "robot", "value": "x"}]},
            r"\$\.conversations\[0\]\.from: unknown speaker 'robot'",  # one object: "$", not "$[0]"
        ),
        ("role.json", [{"role": "narrator", "content": "x"}], r"\$\[0\]: unknown role 'narrator'"),
        ("type.json", [{"type": "alien", "data": {"content": "x"}}], r"\$\[0\]\.type: unknown message type 'alien'"),
        ("what.json", {"hello": "world"}, "cannot tell the format"),
        ("none.json", [], "holds no messages"),
        ("blank.json", "   ", "empty"),
        (
            "ids.jsonl",
            '{"role": "user", "content": "hi", "conversation_id": "  "}\n',
            r'ids\.jsonl:1: "conversation_id" must not be blank',
        ),
    ],
)
def test_errors_say_where_and_what(tmp_path, name, data, message):
    with pytest.raises(TranscriptError, match=message):
        read_transcripts(write(tmp_path, name, data))


def test_a_langchain_message_type_that_is_not_a_string_is_an_error_not_a_crash(tmp_path):
    with pytest.raises(TranscriptError):
        read_transcripts(write(tmp_path, "lc.json", [{"type": ["human"], "content": "hello"}]))


@pytest.mark.parametrize(
    ("block", "text"),
    [
        ({"type": "search_result", "content": 5, "title": "T"}, "T\n5"),
        ({"type": "tool_result", "content": {"temp": 21}}, '{"temp": 21}'),
        ({"type": "document", "source": {"type": "text", "data": "x"}, "title": 5}, "5\nx"),
        ({"type": "non_standard", "value": {"type": "tool_result", "content": 5}}, "5"),
    ],
)
def test_a_content_block_whose_body_is_no_text_reads_as_its_json_not_a_crash(tmp_path, block, text):
    chat = [{"type": "human", "data": {"content": [block]}}, {"type": "ai", "data": {"content": "ok"}}]
    (transcript,) = read_transcripts(write(tmp_path, "blocks.json", chat))  # LangChain's layout takes every block
    assert transcript.messages[0].content == text


@pytest.mark.parametrize(
    ("record", "named"),
    [
        ({"role": "tool", "tool_call_id": {"a": 1}, "content": "r"}, '"tool_call_id" must be a string'),
        ({"role": "tool", "tool_call_id": "c1", "name": ["f"], "content": "r"}, '"name" must be a string'),
        (
            {"role": "assistant", "tool_calls": [{"id": ["x"], "function": {"name": "f", "arguments": "{}"}}]},
            '"tool_calls[0].id" must be a string',
        ),
    ],
)
def test_a_call_id_or_tool_name_that_is_no_string_is_an_error_naming_it(tmp_path, record, named):
    with pytest.raises(TranscriptError, match=re.escape(named)):
        read_transcripts(write(tmp_path, "ids.json", [{"role": "user", "content": "hi"}, record]))


def test_a_conversation_whose_id_is_null_is_named_by_its_index(tmp_path):
    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    openai = read_transcripts(write(tmp_path, "oa.json", [{"id": None, "messages": hello}] * 2))
    sharegpt = read_transcripts(
        write(tmp_path, "sg.json", [{"id": None, "conversations": [{"from": "human", "value": "hi"}]}])
    )
    assert [t.conversation_id for t in openai] == ["oa-0", "oa-1"] and sharegpt[0].conversation_id == "sg-0"
    lines = write(
        tmp_path, "nulls.jsonl", "".join(json.dumps({"id": None, "messages": hello}) + "\n" for _ in range(2))
    )
    assert [t.conversation_id for t in read_transcripts(lines)] == ["nulls-1", "nulls-2"]  # by line, as with no id


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_hostile_input_is_a_transcript_error_or_a_transcript_never_a_crash(tmp_path_factory, payload):
    path = tmp_path_factory.mktemp("fuzz") / "input.json"
    if isinstance(payload, bytes):
        path.write_bytes(payload)
    else:
        path.write_text(payload, encoding="utf-8")
    try:
        transcripts = read_transcripts(path)
    except TranscriptError:
        return
    assert all(t.messages for t in transcripts)


# JSON built from the keys the readers look at, with any JSON value under them: the
# shapes hostile text rarely reaches ({"type": ["text"]}, {"from": {"a": 1}}, ...)
_KEYS = st.sampled_from(
    ["role", "content", "type", "text", "data", "from", "value", "messages", "conversations", "id",
     "tool_calls", "tool_call_id", "function", "name", "arguments", "kwargs", "lc", "system", "refusal",
     "conversation_id", "tools", "additional_kwargs", "source", "title", "json", "output", "tool_use_id"]
)  # fmt: skip
_NAMES = st.sampled_from(
    ["user", "assistant", "system", "tool", "human", "ai", "gpt", "text", "function", "Hi", "tool_result",
     "search_result", "document", "non_standard", "json", "custom_tool_call_output", "refusal", "image"]
)  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _NAMES | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_any_json_under_the_keys_readers_read_is_a_transcript_error_or_a_transcript(tmp_path_factory, data, lines):
    path = tmp_path_factory.mktemp("shapes") / ("input.jsonl" if lines else "input.json")
    text = "\n".join(json.dumps(item) for item in data) if lines and isinstance(data, list) else json.dumps(data)
    path.write_text(text, encoding="utf-8")
    try:
        transcripts = read_transcripts(path)
    except TranscriptError:
        return
    messages = [m for t in transcripts for m in t.messages]  # a conversation of a file of several may be empty
    assert messages and all(m.role in {"system", "user", "assistant", "tool"} for m in messages)
    assert all(isinstance(m.content, str) and all(isinstance(c, dict) for c in m.tool_calls) for m in messages)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ('[\n {"role": "user", "content": "Hi"},\n {"role": "assistant", "content": "Yo"},\n]\n', 4, "Expecting"),
        ('{"messages": [\n {"role": "user", "content": "Hi"}\n {"role": "assistant", "content": "x"}]}\n', 3, "','"),
    ],
    ids=["trailing-comma", "missing-comma"],
)
def test_a_broken_document_over_several_lines_is_named_by_the_line_that_breaks_it(tmp_path, text, line, reason):
    path = tmp_path / "chat.json"
    path.write_text(text)
    with pytest.raises(TranscriptError, match=rf"chat.json:{line}: not valid JSON \(.*{reason}"):
        read_transcripts(path)  # auto: the document's own error, not line 1's


def test_a_line_that_is_not_utf8_is_named_or_skipped(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = [json.dumps({"role": "user", "content": c}).encode() for c in ("hello", "still here")]
    path.write_bytes(b"\n".join([good[0], b'{"role": "user", "content": "\xff\xfe"}', good[1]]) + b"\n")
    with pytest.raises(TranscriptError, match=r"chat\.jsonl:2: not valid UTF-8"):
        read_transcripts(path)
    skipped: list[TranscriptError] = []
    [transcript] = read_transcripts(path, skipped=skipped)
    assert [m.content for m in transcript.messages] == ["hello", "still here"]
    assert [str(e) for e in skipped] == [f"{path}:2: not valid UTF-8"]


def test_langchain_messages_dumped_flat_are_read_like_messages_to_dict(tmp_path):
    from langchain_core.messages import AIMessage, HumanMessage, messages_to_dict

    messages = [HumanMessage("Weather in Porto?"), AIMessage("Sunny.")]
    flat, nested = tmp_path / "flat.json", tmp_path / "nested.json"
    flat.write_text(json.dumps([m.model_dump() for m in messages]))
    nested.write_text(json.dumps(messages_to_dict(messages)))
    read = [[(m.role, m.content) for m in read_transcripts(p)[0].messages] for p in (flat, nested)]
    assert read[0] == read[1] == [("user", "Weather in Porto?"), ("assistant", "Sunny.")]


def test_langchain_dumpd_output_and_one_message_dict_per_line_are_read(tmp_path):
    """What langchain_core.load.dumpd writes (a helper's sweep: 'cannot tell the format'),
    and a JSONL file of message dicts (its hint had pointed to --format jsonl, which failed)."""
    from langchain_core.load import dumpd
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    call = {"name": "get_weather", "args": {"city": "Porto"}, "id": "c1"}
    messages = [HumanMessage("Weather?"), AIMessage("", tool_calls=[call]), ToolMessage("sunny", tool_call_id="c1")]
    dumped, lines = tmp_path / "dumped.json", tmp_path / "lines.jsonl"
    dumped.write_text(json.dumps([dumpd(m) for m in messages]))
    lines.write_text("\n".join(json.dumps(m.model_dump()) for m in messages))
    for path in (dumped, lines):
        [transcript] = read_transcripts(path)
        assert [m.role for m in transcript.messages] == ["user", "assistant", "tool"]
        assert transcript.messages[1].tool_calls[0]["name"] == "get_weather"


def test_roles_as_exports_spell_them_and_openais_legacy_function_messages(tmp_path):
    path = tmp_path / "chat.json"
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    path.write_text(
        json.dumps(
            [
                {"role": "User", "content": "Weather in Oslo?"},
                {"role": "Assistant", "content": None, "function_call": call},
                {"role": "function", "name": "get_weather", "content": '{"temp_c": -3}'},
                {"role": "ASSISTANT", "content": "It is -3 C."},
            ]
        )
    )
    [transcript] = read_transcripts(path)
    assert [m.role for m in transcript.messages] == ["user", "assistant", "tool", "assistant"]
    assert transcript.messages[1].tool_calls[0]["function"]["name"] == "get_weather"


def test_tools_a_conversation_declares_are_read_as_openai_specs(tmp_path):
    from clm_middleware.replay.formats import declared_tools_note

    openai, sharegpt = tmp_path / "o.json", tmp_path / "s.json"
    spec = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    openai.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [spec]}))
    sharegpt.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": "Hi"}], "tools": json.dumps([{"name": "add"}])}])
    )
    assert [t.tools for t in read_transcripts(openai)] == [(spec,)]
    assert [t.tool_names for t in read_transcripts(sharegpt)] == [("add",)]
    note = declared_tools_note(read_transcripts(openai) + read_transcripts(sharegpt))
    assert note is not None and "2 conversation(s) declare tools (add, get_weather)" in note
    assert declared_tools_note(read_transcripts(openai)[:0]) is None
    openai.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"parameters": {}}]}))
    with pytest.raises(TranscriptError, match=r'\$\.tools\[0\]: a tool needs a string "name"'):
        read_transcripts(openai)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1e"])
def test_line_separators_json_allows_inside_a_string_do_not_split_a_jsonl_line(tmp_path, separator):
    """json.dumps(..., ensure_ascii=False) writes these unescaped; text pasted from web
    pages and editors holds them."""
    text = f"Line one{separator}line two is here."
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    per_message = write(tmp_path, "m.jsonl", "".join(json.dumps(m, ensure_ascii=False) + "\r\n" for m in messages))
    [transcript] = read_transcripts(per_message)
    assert [(m.role, m.content) for m in transcript.messages] == [("user", text), ("assistant", "ok")]
    per_line = write(tmp_path, "c.jsonl", "".join(json.dumps({"messages": messages}, ensure_ascii=False) + "\n" * 2))
    [transcript] = read_transcripts(per_line)
    assert transcript.messages[0].content == text


def test_langchain_conversations_one_per_line_keep_their_ids(tmp_path):
    lines = [
        {
            "id": "a",
            "messages": [
                {"type": "human", "data": {"content": "Hi, I am Ann."}},
                {"type": "ai", "data": {"content": "Hi."}},
            ],
        },
        {
            "id": "b",
            "messages": [
                {"type": "human", "data": {"content": "Two plus two?"}},
                {"type": "ai", "data": {"content": "4."}},
            ],
        },
    ]
    path = write(tmp_path, "lc.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    assert [t.conversation_id for t in read_transcripts(path)] == ["a", "b"]
    unnamed = write(tmp_path, "unnamed.json", {"id": "", "messages": lines[0]["messages"]})
    assert [t.conversation_id for t in read_transcripts(unnamed)] == ["unnamed"]  # a blank id names nothing


def test_a_conversation_per_line_keeps_the_tools_it_declares(tmp_path):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    line = {"id": "d1", "messages": [{"role": "user", "content": "Weather?"}], "tools": [tool]}
    [transcript] = read_transcripts(write(tmp_path, "tools.jsonl", json.dumps(line) + "\n"))
    assert transcript.tool_names == ("get_weather",) and transcript.conversation_id == "tools-d1"


def test_a_file_of_several_conversations_names_the_one_at_fault_by_its_index(tmp_path):
    data = [
        {"messages": [{"role": "user", "content": "a"}]},
        {"messages": [{"role": "user", "content": "c"}, {"content": "b"}]},
    ]
    with pytest.raises(TranscriptError, match=r"\$\[1\]\.messages\[1\]: a message needs a \"role\""):
        read_transcripts(write(tmp_path, "many.json", json.dumps(data)))


def test_an_error_names_the_key_that_holds_the_messages_in_the_file(tmp_path):
    """A conversation under "conversations" read as openai was named "$[0].messages[0]"
    in the error, a key the file does not have (a helper's probe)."""
    data = [{"conversations": [{"role": "user", "content": "a"}, {"content": "b"}]}]
    with pytest.raises(TranscriptError, match=r"\$\[0\]\.conversations\[1\]: a message needs a \"role\""):
        read_transcripts(write(tmp_path, "hf.json", json.dumps(data)), "openai")


def test_a_sharegpt_value_that_is_no_string_is_named_with_its_json_type(tmp_path):
    data = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": None}]}
    with pytest.raises(TranscriptError, match=r"\$\.conversations\[1\]\.value: must be a string, got null"):
        read_transcripts(write(tmp_path, "sg.json", json.dumps(data)))


def test_a_bare_sharegpt_list_names_the_turn_at_its_own_json_path_and_the_missing_value(tmp_path):
    """A file that is the list of turns itself: the turn is ``$[1]``, not a wrapper's path."""
    missing = [{"from": "human", "value": "hi"}, {"from": "gpt"}]
    with pytest.raises(TranscriptError, match=r': \$\[1\]: a turn needs a "value"'):
        read_transcripts(write(tmp_path, "bare.json", json.dumps(missing)))
    skipped: list[TranscriptError] = []  # --on-error skip: the conversation is recorded as skipped
    with pytest.raises(TranscriptError, match="the file holds no messages"):  # its only one
        read_transcripts(tmp_path / "bare.json", skipped=skipped)
    assert len(skipped) == 1 and '$[1]: a turn needs a "value"' in str(skipped[0])
    unknown = [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]
    with pytest.raises(TranscriptError, match=r": \$\[1\]\.from: unknown speaker 'robot'"):
        read_transcripts(write(tmp_path, "robot.json", json.dumps(unknown)))


def test_a_missing_or_null_content_is_refused_alike_in_every_format(tmp_path):
    """As OpenAI's API: a user or system message needs its text (null is no text), a reply
    needs text or tool calls; a LangChain message without a content is no exception."""
    null_user = write(tmp_path, "null.jsonl", json.dumps({"role": "user", "content": None}) + "\n")
    with pytest.raises(TranscriptError, match=r'null.jsonl:1: a user message\'s "content" is null'):
        read_transcripts(null_user)
    no_content = [{"type": "human", "data": {"content": "hi"}}, {"type": "ai", "data": {}}]
    with pytest.raises(TranscriptError, match=r'\$\[1\]: an assistant message needs a "content" or "tool_calls"'):
        read_transcripts(write(tmp_path, "lc.json", json.dumps(no_content)))
    calls_only = [
        {"type": "human", "data": {"content": "hi"}},
        {"type": "ai", "data": {"content": None, "tool_calls": [{"name": "f", "args": {}, "id": "1"}]}},
    ]
    [transcript] = read_transcripts(write(tmp_path, "calls.json", json.dumps(calls_only)))
    assert transcript.messages[1].content == "" and transcript.messages[1].tool_calls


def test_a_structure_error_in_a_folder_with_a_colon_names_the_path_once(tmp_path):
    folder = tmp_path / "dir: x"
    folder.mkdir()
    data = {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}
    with pytest.raises(TranscriptError) as raised:
        read_transcripts(write(folder, "conv.json", json.dumps(data)))
    message = str(raised.value)
    assert message.startswith(f'{folder / "conv.json"}: $.messages[1]: a message needs a "role"')
    assert message.count("conv.json") == 1


def test_conversations_sharing_an_id_stay_two_conversations(tmp_path):
    path = tmp_path / "two.jsonl"
    chat = {"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    assert [t.conversation_id for t in read_transcripts(path)] == ["two-x", "two-x#2"]


def test_hugging_face_conversations_of_role_and_content_are_read(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = tmp_path / "hf.json"
    path.write_text(json.dumps([{"conversations": turns}]))
    assert [m.role for m in read_transcripts(path)[0].messages] == ["user", "assistant"]


def test_a_jsonl_file_of_bare_message_lists_is_one_conversation_per_line(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = tmp_path / "lists.jsonl"
    path.write_text(json.dumps(turns) + "\n" + json.dumps(turns[:1]) + "\n")
    assert [len(t.messages) for t in read_transcripts(path)] == [2, 1]


def test_a_sharegpt_system_field_is_the_system_message(tmp_path):
    path = tmp_path / "sg.json"
    chat = {"system": "You are a pirate.", "conversations": [{"from": "human", "value": "hi"}]}
    path.write_text(json.dumps([chat]))
    messages = read_transcripts(path)[0].messages
    assert (messages[0].role, messages[0].content) == ("system", "You are a pirate.")


@pytest.mark.parametrize("role", ["assistant", "tool"])
def test_a_reply_or_tool_result_without_content_is_an_error_naming_the_line(tmp_path, role):
    path = tmp_path / "misnamed.jsonl"
    lines = [{"role": "user", "content": "hi"}, {"role": role, "text": "hello"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with pytest.raises(TranscriptError, match=r'misnamed.jsonl:2: .* needs a "content"'):
        read_transcripts(path)


def _roles_and_texts(transcript):
    return [(m.role, m.content) for m in transcript.messages]


def test_langchain_chat_messages_take_their_own_role_and_function_messages_are_tool_results(tmp_path):
    dump = [
        {"type": "chat", "data": {"content": "Be terse.", "role": "system"}},
        {"type": "human", "data": {"content": "Weather in Porto?"}},
        {
            "type": "ai",
            "data": {
                "content": "",
                "additional_kwargs": {"function_call": {"name": "get_weather", "arguments": '{"city": "Porto"}'}},
            },
        },
        {"type": "function", "data": {"content": "18C", "name": "get_weather"}},
        {"type": "AIMessageChunk", "data": {"content": "It is 18C.", "tool_calls": []}},
        {"type": "chat", "data": {"content": "thanks", "role": "User"}},
    ]
    [transcript] = read_transcripts(write(tmp_path, "lc.json", dump))
    assert [m.role for m in transcript.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert transcript.messages[2].tool_calls[0]["function"]["name"] == "get_weather"
    assert transcript.messages[3].content == "18C"
    bad = [{"type": "chat", "data": {"content": "x", "role": "narrator"}}]
    with pytest.raises(TranscriptError, match=r"\$\[0\]\.data\.role: .*'narrator'"):
        read_transcripts(write(tmp_path, "bad.json", bad))


def test_langchain_tool_calls_in_additional_kwargs_and_content_blocks_are_read_as_chatclm_reads_them(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Porto"}'}}
    dump = [
        {
            "type": "human",
            "data": {
                "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
            },
        },
        {"type": "ai", "data": {"content": "", "additional_kwargs": {"tool_calls": [call]}}},
        {"type": "tool", "data": {"content": [{"type": "json", "json": {"temp": 18}}], "tool_call_id": "c1"}},
        {
            "type": "ai",
            "data": {
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                ],
                "tool_calls": [{"name": "f", "args": {}, "id": "t1"}],
            },
        },
    ]
    [transcript] = read_transcripts(write(tmp_path, "lc.json", dump))
    user, legacy, tool, anthropic = transcript.messages
    assert user.content == "What is this?\n[image_url omitted]"  # the gap is named, not hidden
    assert legacy.tool_calls == (call,)
    assert json.loads(tool.content) == {"temp": 18}
    assert anthropic.content == "Let me check." and anthropic.tool_calls[0]["name"] == "f"


@pytest.mark.parametrize(
    ("tool_calls", "where"),
    [
        (["get_weather"], r"\$\[0\]\.data\.tool_calls\[0\]: a call needs"),
        ({"name": "f"}, r"\$\[0\]\.data\.tool_calls: must be a list"),
    ],
)
def test_malformed_langchain_tool_calls_are_an_error_naming_them_not_a_crash(tmp_path, tool_calls, where):
    dump = [{"type": "ai", "data": {"content": "", "tool_calls": tool_calls}}]
    with pytest.raises(TranscriptError, match=where):
        read_transcripts(write(tmp_path, "lc.json", dump))


def test_a_system_prompt_beside_the_messages_is_the_first_message(tmp_path):
    anthropic = {
        "system": [{"type": "text", "text": "You are a pirate."}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    [one] = read_transcripts(write(tmp_path, "a.json", anthropic))
    assert _roles_and_texts(one) == [("system", "You are a pirate."), ("user", "hi")]
    line = json.dumps({"system": "Be terse.", "messages": [{"role": "user", "content": "hi"}]})
    [per_line] = read_transcripts(write(tmp_path, "b.jsonl", line + "\n"))
    assert _roles_and_texts(per_line) == [("system", "Be terse."), ("user", "hi")]
    with pytest.raises(TranscriptError, match=r"\$\.system: "):
        read_transcripts(write(tmp_path, "c.json", {"system": 5, "messages": [{"role": "user", "content": "hi"}]}))


def test_an_assistant_refusal_field_or_part_is_what_it_said(tmp_path):
    said = "I can't help with that."
    for name, reply in (
        ("field.json", {"role": "assistant", "content": None, "refusal": said}),
        ("part.json", {"role": "assistant", "content": [{"type": "refusal", "refusal": said}]}),
    ):
        [transcript] = read_transcripts(write(tmp_path, name, [{"role": "user", "content": "hi"}, reply]))
        assert transcript.messages[1].content == said, name
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": said}]}]
    with pytest.raises(TranscriptError, match="refusal part belongs to an assistant"):
        read_transcripts(write(tmp_path, "user.json", user_refusal))


def test_an_anthropic_tool_use_block_in_openai_content_is_an_error_not_a_silent_drop(tmp_path):
    reply = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
    with pytest.raises(TranscriptError, match=r"content\[0\]\" is a tool_use block"):
        read_transcripts(write(tmp_path, "a.json", [{"role": "user", "content": "hi"}, reply]))


def test_a_pretty_printed_json_document_saved_as_jsonl_is_read_as_the_document(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    [transcript] = read_transcripts(write(tmp_path, "pretty.jsonl", json.dumps(messages, indent=2)))
    assert _roles_and_texts(transcript) == [("user", "hi"), ("assistant", "hello")]
    with pytest.raises(TranscriptError, match=r"broken\.jsonl:1: not valid JSON"):
        read_transcripts(write(tmp_path, "broken.jsonl", '[\n  {"role": "user",\n'))


def test_a_message_line_after_a_conversation_line_is_an_error_naming_it_not_a_conversation_of_its_own(tmp_path):
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
        json.dumps({"role": "user", "content": "and this?"}),
    ]
    with pytest.raises(TranscriptError, match=r"mixed\.jsonl:2: one message, in a file whose first line"):
        read_transcripts(write(tmp_path, "mixed.jsonl", "\n".join(lines) + "\n"))
