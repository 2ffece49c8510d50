"""Transcripts: conversations to replay, read from files.

A transcript is an ordered list of messages; a file may hold several, grouped by
``conversation_id``. Readers never guess silently: a malformed line raises
``TranscriptError`` naming ``FILE:LINE`` and what was expected.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clm_middleware.errors import TranscriptError
from clm_middleware.render.chat_format import ROLE_SPELLINGS, canonical_role, lone_surrogate
from clm_middleware.render.content import block_text, join_text_parts


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    line: int | None = None  # where the message starts in its file, for error messages
    name: str | None = None  # tool name, for tool results
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Transcript:
    conversation_id: str
    messages: tuple[Message, ...]
    source: str = ""
    probes: tuple[dict[str, str], ...] = field(default=())
    # the tools the conversation declared (OpenAI "tools" / legacy "functions", ShareGPT
    # "tools"), as OpenAI function specs: every replay mode shows them in the system
    # message, as the model that had the conversation saw them; a replay runs none
    tools: tuple[dict[str, Any], ...] = field(default=())

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(str(spec["function"].get("name", "?")) for spec in self.tools)

    @property
    def num_user_turns(self) -> int:
        return sum(message.role == "user" for message in self.messages)


def read_jsonl(path: str | Path, skipped: list[TranscriptError] | None = None) -> list[Transcript]:
    """One JSON object per line: ``{"role", "content"}``, optional ``conversation_id``.

    Blank lines are skipped. Lines of one conversation need not be adjacent; the
    conversations come out in order of first appearance. With a ``skipped`` list, a
    line that cannot be read is appended there (``FILE:LINE: problem``) and left out,
    instead of ending the read.
    """
    path = Path(path)
    return parse_jsonl(_read_text(path, skipped), path, skipped)


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split at ``\n`` only (a ``\r`` before it is JSON
    whitespace). ``str.splitlines`` would also split inside strings at U+2028, U+2029,
    U+0085 and other separators that JSON allows unescaped (``json.dumps(...,
    ensure_ascii=False)`` writes them so), breaking a valid line in two."""
    return text.split("\n")


def first_record(text: str) -> Any:
    """The JSON value of the first non-blank line of ``text``; None if it is none."""
    line = next((line for line in json_lines(text) if line.strip()), "")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None


def one_document(text: str) -> bool:
    """Whether ``text`` is one JSON document spread over lines (a pretty-printed export
    saved as ``.jsonl``, or read with ``--format jsonl``): its first line is no JSON
    value, the whole text is an array or an object."""
    if first_record(text) is not None or not text.strip():
        return False
    try:
        return isinstance(json.loads(text), list | dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def parse_jsonl(text: str, path: Path, skipped: list[TranscriptError] | None = None) -> list[Transcript]:
    """``read_jsonl`` of ``text`` already read from ``path``."""
    groups: dict[str, list[Message]] = {}
    for number, raw in enumerate(json_lines(text), start=1):
        if not raw.strip():
            continue
        try:
            conversation, message = _jsonl_line(raw, path, number)
        except TranscriptError as error:
            if not groups and one_document(text):  # a JSON file read as JSON Lines
                raise TranscriptError(
                    str(path),
                    None,
                    "is one JSON document, not one message per line; use --format auto "
                    "(or openai, sharegpt, langchain)",
                ) from None
            if skipped is None:
                raise
            skipped.append(error)
            continue
        groups.setdefault(conversation, []).append(message)
    if not groups:
        raise TranscriptError(str(path), None, "the file holds no messages")
    return [Transcript(cid, tuple(messages), str(path)) for cid, messages in groups.items()]


def _jsonl_line(raw: str, path: Path, number: int) -> tuple[str, Message]:
    """``(conversation id, message)`` of one JSONL line."""
    record = load_json(raw, str(path), number)
    if not isinstance(record, dict):
        raise TranscriptError(str(path), number, 'expected an object like {"role": "user", "content": "..."}')
    message = message_from_record(record, str(path), number)
    conversation = record.get("conversation_id", path.stem)
    if not isinstance(conversation, str | int) or isinstance(conversation, bool):
        kind = type(conversation).__name__
        raise TranscriptError(str(path), number, f'"conversation_id" must be a string or a number, got {kind}')
    if not str(conversation).strip():
        raise TranscriptError(str(path), number, '"conversation_id" must not be blank')
    return str(conversation), message


_OR_CALLS = {"assistant": ' or "tool_calls"', "tool": ""}
_ARTICLE = {"assistant": "an", "tool": "a"}


def message_from_record(record: dict[str, Any], path: str, line: int | None) -> Message:
    """Validate one ``{"role", "content", ...}`` record."""
    written = record.get("role")  # "User", "developer", "function": as people's exports spell them
    accepted = sorted(ROLE_SPELLINGS)  # one list in both errors
    if written is None:
        raise TranscriptError(path, line, f'a message needs a "role", one of {accepted}; got keys {sorted(record)}')
    role = canonical_role(written)
    if role is None:
        raise TranscriptError(path, line, f"unknown role {written!r}; expected one of {accepted}")
    if role in ("user", "system") and "content" not in record:  # "" is a message; no key is a misnamed field
        raise TranscriptError(path, line, f'a {role} message needs a "content"; got keys {sorted(record)}')
    if role in ("user", "system") and record["content"] is None:  # as OpenAI's API: only a reply may be null
        raise TranscriptError(path, line, f'a {role} message\'s "content" is null; give its text ("" for an empty one)')
    content = _content_text(record.get("content"), path, line, role)
    refusal = record.get("refusal")
    if role == "assistant" and isinstance(refusal, str) and not content:
        content = refusal  # OpenAI's refusal field: what the assistant said, as clm serve reads it
    tool_calls = record.get("tool_calls") or ()
    if record.get("tool_call"):
        tool_calls = (record["tool_call"],)
    elif isinstance(record.get("function_call"), dict):  # OpenAI's legacy single call
        tool_calls = ({"type": "function", "function": record["function_call"]},)
    if not isinstance(tool_calls, list | tuple) or not all(isinstance(c, dict) for c in tool_calls):
        raise TranscriptError(path, line, '"tool_calls" must be a list of objects')
    for index, call in enumerate(tool_calls):
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            where = f"tool_calls[{index}]" + (".function" if "function" in call else "")
            raise TranscriptError(path, line, f'"{where}" must be an object with a string "name"')
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise TranscriptError(path, line, f'"tool_calls[{index}].id" must be a string')
    for key in ("name", "tool_call_id"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise TranscriptError(path, line, f'"{key}" must be a string, got {type(record[key]).__name__}')
    if role != "assistant" and tool_calls:
        raise TranscriptError(path, line, f"a {role} message cannot carry tool calls")
    if "content" not in record and not tool_calls:  # a reply or tool result under another key ("text")
        raise TranscriptError(
            path,
            line,
            f'{_ARTICLE[role]} {role} message needs a "content"{_OR_CALLS[role]}; got keys {sorted(record)}',
        )
    return Message(
        role=role,
        content=content,
        line=line,
        name=record.get("name"),
        tool_calls=tuple(tool_calls),
        tool_call_id=record.get("tool_call_id"),
    )


def load_json(text: str, path: str, line: int | None) -> Any:
    """``json.loads`` whose every failure is a ``TranscriptError`` at ``path:line``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise TranscriptError(
            path, line if line is not None else error.lineno, f"not valid JSON ({error.msg})"
        ) from None
    except RecursionError:
        raise TranscriptError(path, line, "JSON nested too deeply to be a transcript") from None


_CALL_PARTS = frozenset({"tool_use", "tool_result", "tool_call", "function_call"})  # Anthropic's and others' blocks


def _content_text(content: Any, path: str, line: int | None, role: str) -> str:
    """A message's text: a string, or OpenAI content parts: text parts (or plain
    strings), an assistant's refusal parts as their text, media named (``[image_url
    omitted]``: a text model reads none of it, and the gap is not hidden)."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif not isinstance(part, dict):
                raise TranscriptError(path, line, f'"content[{index}]" is not a part ({type(part).__name__!r})')
            elif part.get("type") is not None and not isinstance(part["type"], str):
                raise TranscriptError(
                    path, line, f'"content[{index}].type" must be a string, got {type(part["type"]).__name__}'
                )
            elif part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise TranscriptError(path, line, f'"content[{index}].text" must be a string')
                parts.append(part["text"])
            elif part.get("type") == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            elif part.get("type") == "refusal":
                raise TranscriptError(
                    path, line, f'"content[{index}]": a refusal part belongs to an assistant and needs its "refusal"'
                )
            elif part.get("type") in _CALL_PARTS:
                raise TranscriptError(
                    path,
                    line,
                    f'"content[{index}]" is a {part["type"]} block: give calls in "tool_calls" and results as '
                    "tool messages (OpenAI's layout)",
                )
            else:
                shown = block_text(part)
                if shown is not None:
                    parts.append(shown)
        content = join_text_parts(parts)
    if not isinstance(content, str):
        raise TranscriptError(path, line, f'"content" must be a string, got {type(content).__name__}')
    bad = lone_surrogate(content)
    if bad is not None:
        raise TranscriptError(path, line, f'"content" holds {bad!r}, a lone surrogate: not Unicode text')
    return content


def _read_text(path: Path, skipped: list[TranscriptError] | None = None) -> str:
    """The file's text. A line that is not UTF-8 is an error naming it; given a
    ``skipped`` list (``--on-error skip``), it is recorded there and read as blank (line
    numbers stay those of the file). The path ``-`` reads standard input, as Unix tools do."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except FileNotFoundError:
        raise TranscriptError(str(path), None, "no such file") from None
    except IsADirectoryError:
        raise TranscriptError(str(path), None, "is a directory, not a transcript file") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        if skipped is None:
            line = data[: error.start].count(b"\n") + 1
            raise TranscriptError(str(path), line, "not valid UTF-8") from None
    lines = []
    for number, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            skipped.append(TranscriptError(str(path), number, "not valid UTF-8"))
            lines.append("")
    return "\n".join(lines)
