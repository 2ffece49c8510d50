"""Transcript formats: detect them and read them into ``Transcript`` objects.

- ``jsonl``: one ``{"role", "content"}`` object per line; an optional
  ``conversation_id`` groups lines into conversations. A JSONL file whose lines are
  whole conversations (ShareGPT ``{"conversations": [...]}``, OpenAI fine-tuning
  ``{"messages": [...]}``, LangChain ``{"messages": [{"type", "data"}]}``), the usual way
  datasets ship, is read one conversation per line, in whichever of those formats.
- ``openai``: a list of OpenAI chat messages, ``{"messages": [...]}``, or a list of
  such objects or of bare message lists (``traj``, and Hugging Face chat datasets'
  ``conversations`` of ``{"role", "content"}``, are accepted for ``messages``); tool
  calls and tool messages included; a ``system`` beside ``messages`` (Anthropic's
  layout, many request logs) is the first message.
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``,
  or a list of them; a ``system`` field beside ``conversations`` (LLaMA-Factory) is the
  system message.
- ``langchain``: ``messages_to_dict`` output, ``[{"type": "human"|"ai"|"system"|"tool",
  "data": {...}}]``, messages dumped flat (``[m.model_dump() for m in messages]``:
  ``{"type", "content", ...}``), or ``{"messages": [...]}`` of either; chat messages
  (their ``role``), function messages and streamed chunks too; content blocks read as
  ``ChatCLM`` reads them; tool calls from ``tool_calls`` or, in older dumps,
  ``additional_kwargs``.

Errors name the file and where: ``FILE:LINE`` for JSONL and for JSON syntax, a JSON
path (``conversations[2].from``) for structure. Given a ``skipped`` list (``clm replay
--on-error skip``), ``read_transcripts`` leaves out a JSONL line or one conversation of
a many-conversation file that cannot be read, and appends its error there; a problem
with the file as a whole (not JSON, empty, no format) still raises. Probes for retention can sit next to
a transcript as ``<name>.probes.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clm_middleware.errors import TranscriptError
from clm_middleware.render.chat_format import ROLE_SPELLINGS, canonical_role
from clm_middleware.render.content import blocks_text
from clm_middleware.replay.transcript import (
    Message,
    Transcript,
    _read_text,
    first_record,
    json_lines,
    load_json,
    message_from_record,
    one_document,
    parse_jsonl,
)

FORMATS = ("auto", "jsonl", "openai", "sharegpt", "langchain")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}
# a message dict's "type": each message class's, and its streamed chunk's; a chat message's
# role is its own "role" field, a function message is a tool result
_LANGCHAIN_ROLES = {
    "human": "user",
    "HumanMessageChunk": "user",
    "ai": "assistant",
    "AIMessageChunk": "assistant",
    "system": "system",
    "SystemMessageChunk": "system",
    "tool": "tool",
    "ToolMessageChunk": "tool",
    "function": "tool",
    "FunctionMessageChunk": "tool",
    "chat": "chat",
    "ChatMessageChunk": "chat",
}


def read_transcripts(
    path: str | Path, fmt: str = "auto", skipped: list[TranscriptError] | None = None
) -> list[Transcript]:
    """Read ``path`` in format ``fmt`` (``auto`` sniffs it); ``skipped``: see the module
    docstring. Conversation ids are unique: a second conversation with the id of an
    earlier one (two lines both ``"id": "x"``) is ``x#2``, never a continuation of it."""
    return _unique_ids(_read_transcripts(Path(path), fmt, skipped))


def _unique_ids(transcripts: list[Transcript]) -> list[Transcript]:
    seen: dict[str, int] = {}
    unique = []
    for transcript in transcripts:
        name = transcript.conversation_id
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            transcript = dataclasses.replace(transcript, conversation_id=f"{name}#{seen[name]}")
        unique.append(transcript)
    return unique


def _read_transcripts(path: Path, fmt: str, skipped: list[TranscriptError] | None) -> list[Transcript]:
    if fmt not in FORMATS:
        raise TranscriptError(str(path), None, f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    text = _read_text(path, skipped)
    if fmt == "jsonl" or (fmt == "auto" and path.suffix == ".jsonl" and not one_document(text)):
        if _conversation_per_line(text):
            return _documents_per_line(text, path, "auto" if fmt == "jsonl" else fmt, skipped)
        if _is_langchain_message(first_record(text)):  # one LangChain message dict per line
            return _langchain_lines(text, path)
        return parse_jsonl(text, path, skipped)
    if not text.strip():
        raise TranscriptError(str(path), None, "the file is empty")
    try:
        data = load_json(text, str(path), None)
    except TranscriptError:
        if "\n" in text.strip() and _conversation_per_line(text):
            return _documents_per_line(text, path, fmt, skipped)
        if fmt in ("auto", "langchain") and _is_langchain_message(first_record(text)):
            return _langchain_lines(text, path)
        if fmt == "auto" and isinstance(first_record(text), dict) and "\n" in text.strip():
            return parse_jsonl(text, path, skipped)  # JSON lines with another extension
        # otherwise a document spread over lines: its own error names the line that breaks it
        if _looks_like_json_lines(text):
            raise TranscriptError(
                str(path), None, f"holds one JSON message per line, not one {fmt} document; use --format jsonl"
            ) from None
        raise
    reader = _READERS[_detect(data, str(path)) if fmt == "auto" else fmt]
    transcripts = reader(data, str(path), skipped)
    if not transcripts or not any(t.messages for t in transcripts):
        raise TranscriptError(str(path), None, "the file holds no messages")
    return transcripts


def _conversation_per_line(text: str) -> bool:
    """Whether the first line is a whole conversation, not one message."""
    first = first_record(text)
    if isinstance(first, list):  # a bare list of messages per line
        return _is_message_list(first)
    return (
        isinstance(first, dict)
        and "role" not in first
        and any(k in first for k in ("conversations", "messages", "traj"))
    )


def _documents_per_line(text: str, path: Path, fmt: str, skipped: list[TranscriptError] | None) -> list[Transcript]:
    """One conversation per JSON line, each read in ``fmt`` (``auto``: detected per line);
    errors name ``FILE:LINE``."""
    transcripts: list[Transcript] = []
    for number, raw in enumerate(json_lines(text), start=1):
        if not raw.strip():
            continue
        try:
            document = load_json(raw, str(path), number)
            if isinstance(document, dict) and "role" in document:
                raise TranscriptError(
                    str(path),
                    number,
                    "one message, in a file whose first line is a whole conversation: give every line "
                    "as a conversation, or every line as one message",
                )
            kind = _detect(document, str(path)) if fmt == "auto" else fmt
            read = _READERS[kind](document, str(path), None)
        except TranscriptError as error:
            located = TranscriptError(str(path), number, error.problem)
            if skipped is None:
                raise located from None
            skipped.append(located)
            continue
        named = isinstance(document, dict) and any(document.get(k) is not None for k in _ID_KEYS)
        for transcript in read:  # a line without an id of its own is named by its line
            conversation = transcript.conversation_id if named else f"{path.stem}-{number}"
            transcripts.append(dataclasses.replace(transcript, conversation_id=conversation, source=str(path)))
    if not any(t.messages for t in transcripts):  # as a document of empty conversations is
        raise TranscriptError(str(path), None, "the file holds no messages")
    return transcripts


def _looks_like_json_lines(text: str) -> bool:
    lines = [line for line in json_lines(text) if line.strip()]
    if len(lines) < 2:
        return False
    try:
        return all(isinstance(json.loads(line), dict) for line in lines[:3])
    except (json.JSONDecodeError, RecursionError):
        return False


def _detect(data: Any, path: str) -> str:
    if data == [] or data == {}:
        raise TranscriptError(path, None, "the file holds no messages")
    first = data[0] if isinstance(data, list) and data else data
    if _is_message_list(first):
        return "openai"  # a list of conversations, each a bare list of messages
    if isinstance(first, dict):
        if _is_message_list(first.get("conversations")):
            return "openai"  # {"conversations": [{"role", "content"}, ...]}: Hugging Face chat datasets
        if "conversations" in first or ("from" in first and "value" in first):
            return "sharegpt"
        if _is_langchain_message(first):
            return "langchain"
        messages = first.get("messages")
        if isinstance(messages, list) and messages and _is_langchain_message(messages[0]):
            return "langchain"
        if "role" in first or "messages" in first or "traj" in first:
            return "openai"
    raise TranscriptError(
        path,
        None,
        "cannot tell the format: expected JSONL, OpenAI messages, ShareGPT conversations or "
        "LangChain message dicts (name one with --format)",
    )


def _openai(data: Any, path: str, skipped: list[TranscriptError] | None = None) -> list[Transcript]:
    single = isinstance(data, dict)  # one conversation object: its JSON path is "$", not "$[0]"
    if single:
        data = [data]
    if not isinstance(data, list):
        raise TranscriptError(path, None, "expected a list of messages or of conversations")
    if data and isinstance(data[0], dict) and "role" in data[0]:
        return [Transcript(Path(path).stem, _openai_messages(data, path, "$"), path)]
    return _each(data, path, skipped, _openai_conversation, single=single)


def _is_message_list(value: Any) -> bool:
    """A list of OpenAI-style messages (its first one has a ``role``)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


_MESSAGES_KEYS = ("messages", "traj", "conversations")  # where a conversation object holds its messages


def _openai_conversation(item: Any, number: int, path: str, where: str) -> Transcript:
    if isinstance(item, list):  # a bare list of messages
        return Transcript(f"{Path(path).stem}-{number}", _openai_messages(item, path, where), path)
    if not isinstance(item, dict):
        raise TranscriptError(path, None, f"{where}: expected an object with a messages list")
    key = next((k for k in _MESSAGES_KEYS if k in item), "messages")
    messages = item.get(key)
    if not isinstance(messages, list):
        raise TranscriptError(path, None, f'{where}: expected a "messages" list')
    name = _conversation_name(item, _ID_KEYS, number)
    messages_read = _openai_messages(messages, path, f"{where}.{key}")  # an error names the file's own key
    if "system" in item:  # Anthropic's and many request logs' layout: the system prompt beside the messages
        system = _checked(
            lambda: message_from_record({"role": "system", "content": item["system"]}, path, None),
            path,
            f"{where}.system",
        )
        messages_read = (system, *messages_read)
    return Transcript(f"{Path(path).stem}-{name}", messages_read, path, tools=declared_tools(item, path, where))


def declared_tools(item: dict[str, Any], path: str = "", where: str = "$") -> tuple[dict[str, Any], ...]:
    """The tools a conversation object declares (``tools``, legacy ``functions``; ShareGPT
    datasets give ``tools`` as a JSON string), as OpenAI function specs; a spec with no
    string ``name`` is an error naming it."""
    declared = item.get("tools", item.get("functions"))
    key = "tools" if "tools" in item else "functions"
    if isinstance(declared, str):
        try:
            declared = json.loads(declared)
        except json.JSONDecodeError as error:
            raise TranscriptError(path, None, f"{where}.{key}: not valid JSON ({error.msg})") from None
    if declared is None:
        return ()
    if not isinstance(declared, list):
        raise TranscriptError(path, None, f"{where}.{key}: must be a list of tool specs")
    specs = []
    for number, tool in enumerate(declared):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TranscriptError(path, None, f'{where}.{key}[{number}]: a tool needs a string "name"')
        specs.append({"type": "function", "function": function})
    return tuple(specs)


def declared_tools_note(transcripts: Sequence[Transcript]) -> str | None:
    """A note for conversations that declare tools: shown to the model, never run."""
    declaring = [t for t in transcripts if t.tools]
    if not declaring:
        return None
    names = sorted({name for t in declaring for name in t.tool_names})
    return (
        f"{len(declaring)} conversation(s) declare tools ({', '.join(names)}): every mode shows them to the model "
        "in the system message; a replay runs none (recorded tool calls and results are replayed as recorded)"
    )


def _each(
    items: list[Any],
    path: str,
    skipped: list[TranscriptError] | None,
    read: Callable[[Any, int, str, str], Transcript],
    *,
    single: bool = False,
) -> list[Transcript]:
    """``read`` each conversation of a many-conversation file, given its JSON path (``$``
    for a file that is one conversation object, ``single``); with ``skipped``, one that
    fails is left out and its error (naming its JSON path) appended there."""
    transcripts = []
    for number, item in enumerate(items):
        try:
            transcripts.append(read(item, number, path, "$" if single else f"$[{number}]"))
        except TranscriptError as error:
            if skipped is None:
                raise
            skipped.append(error)
    return transcripts


def _openai_messages(messages: list[Any], path: str, where: str) -> tuple[Message, ...]:
    out = []
    for number, record in enumerate(messages):
        if not isinstance(record, dict):
            raise TranscriptError(path, None, f"{where}[{number}]: expected a message object")
        out.append(_checked(lambda r=record: message_from_record(r, path, None), path, f"{where}[{number}]"))
    return tuple(out)


def _sharegpt(data: Any, path: str, skipped: list[TranscriptError] | None = None) -> list[Transcript]:
    items = data if isinstance(data, list) else [data]
    if items and isinstance(items[0], dict) and "from" in items[0]:  # the turns of one conversation, bare
        bare = functools.partial(_sharegpt_conversation, bare=True)
        return _each([{"conversations": items}], path, skipped, bare, single=True)
    return _each(items, path, skipped, _sharegpt_conversation, single=not isinstance(data, list))


def _sharegpt_conversation(item: Any, number: int, path: str, where: str, *, bare: bool = False) -> Transcript:
    """``bare``: the file is the list of turns itself, so a turn's JSON path is ``$[i]``."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise TranscriptError(path, None, f'{where}: expected {{"conversations": [...]}}')
    messages = []
    system = item.get("system")  # LLaMA-Factory's layout: the system prompt beside the turns
    if system is not None and not isinstance(system, str):
        raise TranscriptError(path, None, f"{where}.system: must be a string, got {type(system).__name__}")
    if isinstance(system, str) and system.strip():
        messages.append(
            _checked(
                lambda: message_from_record({"role": "system", "content": system}, path, None), path, f"{where}.system"
            )
        )
    for index, turn in enumerate(turns):
        at = f"$[{index}]" if bare else f"{where}.conversations[{index}]"
        if not isinstance(turn, dict):
            raise TranscriptError(path, None, f'{at}: expected {{"from": ..., "value": "..."}}')
        if "value" not in turn:
            raise TranscriptError(path, None, f'{at}: a turn needs a "value" (its text), beside "from"')
        if not isinstance(turn["value"], str):
            raise TranscriptError(path, None, f"{at}.value: must be a string, got {_json_type(turn['value'])}")
        source = str(turn.get("from", "")).lower()
        role = _SHAREGPT_ROLES.get(source)
        if role is None:
            raise TranscriptError(
                path,
                None,
                f"{at}.from: unknown speaker {turn.get('from')!r}; expected one of {sorted(_SHAREGPT_ROLES)}",
            )
        record: dict[str, Any] = {"role": role, "content": turn["value"]}
        if source == "function_call":
            record = {"role": "assistant", "content": "", "tool_calls": [_sharegpt_call(turn["value"])]}
        messages.append(_checked(lambda r=record: message_from_record(r, path, None), path, at))
    name = _conversation_name(item, ("id",), number)
    return Transcript(f"{Path(path).stem}-{name}", tuple(messages), path, tools=declared_tools(item, path, where))


def _sharegpt_call(value: str) -> dict[str, Any]:
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        return {"name": "unknown", "arguments": value}
    return call if isinstance(call, dict) else {"name": "unknown", "arguments": call}


_ID_KEYS = ("id", "conversation_id", "task_id")  # what names a conversation, in that order


def _conversation_name(item: dict[str, Any], keys: tuple[str, ...], number: int) -> str:
    """The first of ``keys`` the conversation gives a value (``"id": null`` gives none), else its number."""
    return next((str(item[key]) for key in keys if item.get(key) is not None), str(number))


def _is_langchain_message(item: Any) -> bool:
    """``{"type", "data"}`` (``messages_to_dict``), a flat dump ``{"type": "human", "content",
    ...}``, or ``dumpd``'s ``{"lc": 1, "type": "constructor", "id": [..., "HumanMessage"],
    "kwargs": {...}}``."""
    if not isinstance(item, dict) or "role" in item or "type" not in item:
        return False
    if _constructor_kwargs(item) is not None:
        return True
    return "data" in item or (isinstance(item["type"], str) and item["type"] in _LANGCHAIN_ROLES and "content" in item)


def _constructor_kwargs(item: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of a message ``langchain_core.load.dumpd`` wrote, with its ``type``
    (``"human"``, or the class name when the fields lack one); ``None`` for anything else."""
    ident, kwargs = item.get("id"), item.get("kwargs")
    if item.get("lc") != 1 or item.get("type") != "constructor" or not isinstance(kwargs, dict):
        return None
    if not isinstance(ident, list) or not ident or not str(ident[-1]).endswith(("Message", "MessageChunk")):
        return None
    # fields without a "type": the class's streamed-chunk name, which _LANGCHAIN_ROLES reads
    kind = kwargs.get("type") or str(ident[-1]).removesuffix("Chunk") + "Chunk"
    return {**kwargs, "type": kind}


def _langchain_lines(text: str, path: Path) -> list[Transcript]:
    """A file of one LangChain message dict per line: one conversation."""
    items = [load_json(raw, str(path), number) for number, raw in enumerate(json_lines(text), start=1) if raw.strip()]
    return _langchain(items, str(path))


def _langchain(data: Any, path: str, skipped: list[TranscriptError] | None = None) -> list[Transcript]:
    """One conversation, named by its ``id`` / ``conversation_id`` where it has one, else
    by the file: nothing to skip past, so ``skipped`` is unused."""
    name = Path(path).stem
    if isinstance(data, dict):
        given = [data.get(key) for key in ("id", "conversation_id")]
        name = next((str(value) for value in given if value is not None and str(value).strip()), name)
        data = data.get("messages")
    if not isinstance(data, list):
        raise TranscriptError(path, None, 'expected a list of {"type", "data"} message dicts')
    messages = []
    for number, item in enumerate(data):
        at = f"$[{number}]"
        if isinstance(item, dict) and (fields := _constructor_kwargs(item)) is not None:
            item = {"type": fields["type"], "data": fields}
        if isinstance(item, dict) and "data" not in item and "content" in item:
            item = {"type": item.get("type"), "data": item}  # dumped flat: the fields are the data
        if not isinstance(item, dict) or not isinstance(item.get("data"), dict):
            raise TranscriptError(
                path, None, f'{at}: expected {{"type": ..., "data": {{...}}}} or {{"type": ..., "content": ...}}'
            )
        body = item["data"]
        record = {"role": _langchain_role(item.get("type"), body, path, at)}
        if calls := _langchain_calls(body, path, f"{at}.data"):
            record["tool_calls"] = calls
        record |= {key: body[key] for key in ("tool_call_id", "name") if key in body}
        if "content" in body:  # a message without one is refused as in every other format
            record["content"] = _langchain_content(body["content"], path, f"{at}.data.content")
        messages.append(_checked(lambda r=record: message_from_record(r, path, None), path, at))
    return [Transcript(name, tuple(messages), path)]


def _langchain_role(kind: Any, body: dict[str, Any], path: str, at: str) -> str:
    role = _LANGCHAIN_ROLES.get(str(kind))
    if role is None:
        raise TranscriptError(
            path, None, f"{at}.type: unknown message type {kind!r}; expected one of {sorted(_LANGCHAIN_ROLES)}"
        )
    if role != "chat":
        return role
    spelled = canonical_role(body.get("role", ""))
    if spelled is None:
        raise TranscriptError(
            path,
            None,
            f"{at}.data.role: a chat message's role {body.get('role')!r} is not one a chat template knows; "
            f"expected one of {sorted(ROLE_SPELLINGS)}",
        )
    return spelled


def _langchain_content(content: Any, path: str, where: str) -> Any:
    """A string as it is; content blocks as the model reads them (``render/content.py``)."""
    if not isinstance(content, list):
        return content  # a string, or None; anything else is refused naming "content"
    for index, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "text" and not isinstance(block.get("text"), str):
            raise TranscriptError(path, None, f"{where}[{index}].text: a text block needs its text")
    return blocks_text(content)


def _langchain_calls(body: dict[str, Any], path: str, where: str) -> list[dict[str, Any]]:
    """A message's tool calls: ``tool_calls`` (``{"name", "args", "id"}``), else those an
    older dump keeps in ``additional_kwargs`` (OpenAI's ``tool_calls`` or ``function_call``),
    passed on in OpenAI's shape."""
    calls = body.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise TranscriptError(path, None, f"{where}.tool_calls: must be a list of calls")
        for index, call in enumerate(calls):
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise TranscriptError(path, None, f'{where}.tool_calls[{index}]: a call needs a string "name"')
        return [{"name": c["name"], "arguments": c.get("args", {}), "id": c.get("id")} for c in calls]
    extra = body.get("additional_kwargs")
    if not isinstance(extra, dict):
        return []
    if extra.get("tool_calls"):
        legacy = extra["tool_calls"]
        if not isinstance(legacy, list) or not all(isinstance(c, dict) for c in legacy):
            raise TranscriptError(path, None, f"{where}.additional_kwargs.tool_calls: must be a list of calls")
        return legacy
    if isinstance(extra.get("function_call"), dict):
        return [{"type": "function", "function": extra["function_call"]}]
    return []


def _checked(read: Callable[[], Message], path: str, where: str) -> Message:
    """Re-raise a record error with its JSON path instead of a line number."""
    try:
        return read()
    except TranscriptError as error:
        raise TranscriptError(path, None, f"{where}: {error.problem}") from None


_READERS: dict[str, Callable[[Any, str, list[TranscriptError] | None], list[Transcript]]] = {
    "openai": _openai,
    "sharegpt": _sharegpt,
    "langchain": _langchain,
}


def probes_beside(path: str | Path) -> Path | None:
    """``<name>.probes.json`` next to a transcript, if there is one."""
    path = Path(path)
    candidate = path.with_name(f"{path.stem}.probes.json")
    return candidate if candidate.is_file() else None


def _json_type(value: Any) -> str:
    """A JSON value's type as JSON names it (``null``, ``number``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__
