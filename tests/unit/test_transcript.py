import json

import pytest

from clm_middleware.errors import TranscriptError
from clm_middleware.replay.runner import count_turns, turn_plan
from clm_middleware.replay.transcript import read_jsonl


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_role_content_lines_and_groups_by_conversation(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            json.dumps({"conversation_id": "a", "role": "user", "content": "hi"}),
            json.dumps({"conversation_id": "b", "role": "user", "content": "yo"}),
            "",
            json.dumps({"conversation_id": "a", "role": "assistant", "content": "hello"}),
        ],
    )
    transcripts = read_jsonl(path)
    assert [t.conversation_id for t in transcripts] == ["a", "b"]
    assert [m.role for m in transcripts[0].messages] == ["user", "assistant"]
    assert transcripts[0].messages[1].line == 4


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ['{"role": "user", "content": "ok"}', "{not json"])
    with pytest.raises(TranscriptError, match=r"bad\.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_unknown_role_is_named(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", ['{"role": "narrator", "content": "x"}'])
    with pytest.raises(TranscriptError, match=r"r\.jsonl:1: unknown role 'narrator'"):
        read_jsonl(path)


def test_non_string_content_and_non_object_lines_are_refused(tmp_path):
    with pytest.raises(TranscriptError, match='"content" must be a string'):
        read_jsonl(write_lines(tmp_path / "c.jsonl", ['{"role": "user", "content": 5}']))
    with pytest.raises(TranscriptError, match="expected an object"):
        read_jsonl(write_lines(tmp_path / "l.jsonl", ["[1, 2]"]))


def test_empty_missing_and_binary_files_are_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TranscriptError, match="holds no messages"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(TranscriptError, match="no such file"):
        read_jsonl(tmp_path / "absent.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b'{"role": "user", "content": "a"}\n\xff\xfe\n')
    with pytest.raises(TranscriptError, match=r"bin\.jsonl:2: not valid UTF-8"):
        read_jsonl(tmp_path / "bin.jsonl")


def test_turns_are_the_assistant_positions_plus_a_trailing_question(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            '{"role": "system", "content": "s"}',
            '{"role": "user", "content": "q1"}',
            '{"role": "assistant", "content": "a1"}',
            '{"role": "user", "content": "q2"}',
        ],
    )
    [transcript] = read_jsonl(path)
    plan = turn_plan(transcript)
    assert [[m.content for m in context] for context, _ in plan] == [["s", "q1"], ["q2"]]
    assert [answer.content if answer else None for _, answer in plan] == ["a1", None]
    assert count_turns([transcript]) == 2


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            '{"role": "user", "content": "' + "x" + '", "conversation_id": {"a": 1}}',
            '"conversation_id" must be a string',
        ),
        ('{"role": "user", "content": "\\ud800 hi"}', "lone surrogate"),
        ('{"role": "assistant", "content": "", "tool_calls": [{"function": 5}]}', '"tool_calls\\[0\\].function" must'),
        ('{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}', '"tool_calls\\[0\\]" must'),
        (
            '{"role": "user", "content": [5]}',
            '"content\\[0\\]" is not a part',
        ),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply|expected an object"),
        ('{"role": "user", "text": "hello"}', 'a user message needs a "content"; got keys'),
    ],
)
def test_hostile_records_are_errors_naming_the_line_and_field(tmp_path, line, problem):
    with pytest.raises(TranscriptError, match=r"h\.jsonl:1: .*(" + problem + ")"):
        read_jsonl(write_lines(tmp_path / "h.jsonl", [line]))


def test_empty_and_whitespace_messages_are_read_as_sent(tmp_path):
    lines = ['{"role": "system", "content": ""}', '{"role": "user", "content": "   \\n\\t "}']
    messages = read_jsonl(write_lines(tmp_path / "e.jsonl", lines))[0].messages
    assert [(m.role, m.content) for m in messages] == [("system", ""), ("user", "   \n\t ")]


def test_content_parts_may_be_plain_strings(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}'])
    assert read_jsonl(path)[0].messages[0].content == "a\nb"  # one part per line, as vLLM joins them


def test_json_lines_read_as_another_format_name_the_mismatch(tmp_path):
    from clm_middleware.replay.formats import read_transcripts

    path = write_lines(
        tmp_path / "t.json", ['{"role": "user", "content": "hi"}', '{"role": "assistant", "content": "yo"}']
    )
    with pytest.raises(TranscriptError, match=r"one JSON message per line.*--format jsonl"):
        read_transcripts(path, "sharegpt")


@pytest.mark.parametrize("skip", [False, True])
def test_a_json_document_read_as_json_lines_names_the_mismatch(tmp_path, skip):
    """The reverse mistake said "use --format jsonl"; this one only "not valid JSON"."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], indent=2))
    with pytest.raises(
        TranscriptError, match=r"chat\.json: is one JSON document, not one message per line; use --format auto"
    ):
        read_jsonl(path, [] if skip else None)


def test_a_developer_message_reads_as_a_system_message(tmp_path):
    lines = ['{"role": "developer", "content": "Be brief."}', '{"role": "user", "content": "hi"}']
    (transcript,) = read_jsonl(write_lines(tmp_path / "d.jsonl", lines))
    assert [m.role for m in transcript.messages] == ["system", "user"]
