"""Tools for models whose chat template has no tool support, and the calls they write.

Prompt format (documented in docs/tools.md): the system message lists the tools, one
signature line each (``signature``), and asks for calls written as::

    <tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>

A template that renders ``tools=`` itself (``ChatFormat`` finds where it puts them in
the system message) is used instead. Parsing never raises: a call that is not JSON,
names no known tool, or has non-object arguments becomes an ``invalid_tool_call``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

import regex

from clm_middleware.errors import ConfigError
from clm_middleware.render.tool_calls import CLOSE, OPEN
from clm_middleware.structured.format import ResponseFormat

_CALL = regex.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", regex.DOTALL)

PROMPT_HEADER = (
    "You can call tools. To call one, write one line per call, for example:\n"
    '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>\n'
    "Call a tool only when it helps answer; after a tool result arrives, answer the user.\n"
    "Tools:"
)


def tools_prompt(tools: Sequence[dict[str, Any]], template_tools: str | None = None) -> str:
    """The tools section of the system message: the template's own rendering if it has one,
    else one signature line per tool (see ``signature``) under ``PROMPT_HEADER``."""
    if template_tools:
        return template_tools
    return "\n".join([PROMPT_HEADER, *(signature(tool) for tool in tools)])


def signature(tool: dict[str, Any]) -> str:
    """``- name(a: string, b?: integer, c?: string | null, d: string[]): description``
    (types as ``type_text`` writes them); a parameter with a description gets an
    indented line.
    ``tool`` passed ``check_tools``.

    Compact on purpose: small models copy whatever JSON schema they are shown into
    their arguments, and a schema costs many tokens of context on every turn.
    """
    function = tool.get("function", tool)
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or ())
    parts, notes = [], []
    for name, spec in (parameters.get("properties") or {}).items():
        spec = spec if isinstance(spec, dict) else {}  # a boolean schema: true admits anything
        parts.append(f"{name}{'' if name in required else '?'}: {type_text(spec, parameters)}")
        if spec.get("description"):
            notes.append(f"    {name}: {spec['description']}")
    description = function.get("description", "")
    return "\n".join([f"- {function.get('name')}({', '.join(parts)}): {description}".rstrip(": "), *notes])


def type_text(spec: Any, root: dict[str, Any] | None = None) -> str:
    """A schema as a short type expression, TypeScript-like: ``string``, ``integer |
    null``, ``"a" | "b"``, ``string[]``, ``{name: string, age?: integer}``; a ``$ref``
    into ``root``'s ``$defs``/``definitions`` is followed. Never a schema's keywords: a
    small model shown ``{"items": {"type": "string"}, "type": "array"}`` for a list
    wrote ``["items", "type", "array", ...]`` as its value. What has no short form
    (nesting past three levels, a pattern) is its base type; the grammar, not this text,
    enforces the schema."""
    return " | ".join(_alternatives(spec, root, 0))


def _alternatives(spec: Any, root: dict[str, Any] | None, depth: int) -> list[str]:
    """``type_text`` of ``spec`` as its union's members, each once."""
    if not isinstance(spec, dict):
        return ["any"]
    kind = spec.get("type", "any")
    if depth > 3:
        return [kind if isinstance(kind, str) else "any"]
    reference = spec.get("$ref")
    if isinstance(reference, str):
        for section in ("$defs", "definitions"):
            prefix = f"#/{section}/"
            target = (
                ((root or {}).get(section) or {}).get(reference[len(prefix) :])
                if reference.startswith(prefix)
                else None
            )
            if isinstance(target, dict):
                return _alternatives(target, root, depth + 1)
        return ["any"]
    if isinstance(spec.get("enum"), list):
        return [json.dumps(value) for value in spec["enum"]]
    if "const" in spec:
        return [json.dumps(spec["const"])]
    branches = spec.get("anyOf") or spec.get("oneOf")
    if isinstance(branches, list) and branches and "type" not in spec:
        return list(dict.fromkeys(text for branch in branches for text in _alternatives(branch, root, depth + 1)))
    texts = []
    for one in kind if isinstance(kind, list) else [kind]:
        if one == "array":
            items = _alternatives(spec.get("items", {}), root, depth + 1)
            texts.append(f"({' | '.join(items)})[]" if len(items) > 1 else f"{items[0]}[]")
        elif one == "object" and isinstance(spec.get("properties"), dict) and spec["properties"]:
            required = set(spec.get("required") or ())
            fields = (
                f"{key}{'' if key in required else '?'}: {' | '.join(_alternatives(value, root, depth + 1))}"
                for key, value in spec["properties"].items()
            )
            texts.append("{" + ", ".join(fields) + "}")
        else:
            texts.append(str(one))
    return list(dict.fromkeys(texts))


def check_tools(tools: Sequence[dict[str, Any]], *, field: str = "tools") -> None:
    """Raise ``ConfigError`` naming the field (``tools[1].function.parameters.required``)
    unless each tool's ``parameters`` is a JSON Schema for an object whose ``properties``
    map names to schemas and whose ``required`` lists names, with only the types JSON
    Schema defines (``"type": ["string", "null"]`` included): a tool must be callable
    with the arguments its schema admits, and a malformed one is the caller's mistake."""
    for index, tool in enumerate(tools):
        where = f"{field}[{index}].function.parameters"
        parameters = tool.get("function", tool).get("parameters")
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise ConfigError(where, f"must be a JSON schema object, got {type(parameters).__name__}")
        if parameters.get("type", "object") != "object":
            raise ConfigError(f"{where}.type", "must be 'object': a tool's arguments are a JSON object")
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict) or not all(isinstance(p, dict | bool) for p in properties.values()):
            raise ConfigError(f"{where}.properties", "must map each argument's name to its JSON schema (an object)")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise ConfigError(f"{where}.required", "must be a list of argument names")
        # JSON Schema's types, JSON throughout; keywords no grammar enforces stay (the tool checks them)
        ResponseFormat.from_schema(parameters, field=where, enforce_all=False)


def split_tool_calls(text: str) -> tuple[str, list[str]]:
    """(text outside tool-call tags, the raw payload of each call)."""
    payloads = [m.group(1) for m in _CALL.finditer(text)]
    start = text.find(OPEN)
    return (text[:start].rstrip() if start >= 0 else text), payloads


def parse_tool_calls(
    payloads: Sequence[str], tools: Sequence[dict[str, Any]], *, last_cut: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """LangChain ``tool_calls`` and ``invalid_tool_calls`` from raw payloads.

    ``last_cut``: generation stopped at ``max_tokens`` inside the last call (no closing
    tag). That call is invalid unless its JSON object was written out whole (the cut fell
    in the closing tag, ``}}</tool_call``): its arguments may be cut short (``"age": 3``
    of ``34``), and completing its braces would make a wrong call look valid.

    Arguments a tool's schema does not declare are dropped: they could never reach
    the tool (small models copy schema keywords such as ``"type"`` into them). A call
    that lacks an argument its schema requires is invalid: the tool could not run it
    (and a structured-output parser would fail on it).
    """
    declared = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") for t in tools}
    required = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("required") or () for t in tools}
    valid, invalid = [], []
    for number, payload in enumerate(payloads, start=1):
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        if last_cut and number == len(payloads) and not _written_whole(payload):
            invalid.append(_invalid(_cut_call_name(payload), payload, call_id, CUT_CALL))
            continue
        data, problem = _load_call(payload)
        if problem is not None:
            invalid.append(_invalid(None, payload, call_id, problem))
            continue
        if not isinstance(data, dict):
            invalid.append(_invalid(None, payload, call_id, "a tool call must be a JSON object"))
            continue
        name = data.get("name")
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # a string of JSON: use what it holds
                arguments = json.loads(arguments)
        # a call that parsed reports its arguments, as LangChain's ``args`` holds them
        written = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(name, str) or (declared and name not in declared):
            shown = name if isinstance(name, str) else None
            invalid.append(_invalid(shown, written, call_id, f"unknown tool {name!r}"))
        elif not isinstance(arguments, dict):
            invalid.append(_invalid(name, written, call_id, "arguments must be a JSON object"))
        else:
            properties = declared.get(name)
            if properties:
                arguments = {key: value for key, value in arguments.items() if key in properties}
            missing = [key for key in required.get(name, ()) if key not in arguments]
            if missing:
                names = ", ".join(repr(key) for key in missing)
                invalid.append(_invalid(name, written, call_id, f"missing required argument {names}"))
                continue
            valid.append({"name": name, "args": arguments, "id": call_id, "type": "tool_call"})
    return valid, invalid


def _load_call(payload: str) -> tuple[Any, str | None]:
    """The call's JSON object: the first one in the payload (text after it, when the
    closing tag is missing, is not part of the call); a call whose only flaw is missing
    closing braces (generation stopped right after the arguments) is completed, since
    nothing else can be meant."""
    decoder = json.JSONDecoder()
    text = payload.strip()
    try:
        return decoder.raw_decode(text)[0], None
    except json.JSONDecodeError as error:
        problem = f"not valid JSON: {error.msg}"
    for closers in ("}", "}}"):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(text + closers), None
    return None, problem


_CALL_NAME = regex.compile(r'\A\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _written_whole(payload: str) -> bool:
    """Whether ``payload`` opens with a JSON object as written, closing brace included."""
    try:
        return isinstance(json.JSONDecoder().raw_decode(payload.strip())[0], dict)
    except json.JSONDecodeError:
        return False


def _cut_call_name(payload: str) -> str | None:
    """The tool a cut call names, when its name was written out whole before the cut."""
    match = _CALL_NAME.match(payload)
    return json.loads(f'"{match.group(1)}"') if match else None


CUT_CALL = "the reply reached max_tokens before this call was complete; raise max_tokens"


def _invalid(name: str | None, args: str, call_id: str, error: str) -> dict[str, Any]:
    """LangChain's ``invalid_tool_call``: ``args`` is the call's arguments as JSON when
    the call parsed, else the text the model wrote for the call."""
    return {"name": name, "args": args, "id": call_id, "error": error, "type": "invalid_tool_call"}


CHOOSE_TOOL = OPEN + '{"name": "'  # the reply head before a tool name is chosen


def required_tool(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> str | bool | None:
    """Which tool ``tool_choice`` requires: a name; ``True`` when some tool is required
    but which one is left to the model; ``None`` when no call is required.

    ``"auto"``/``None``/``"none"``: none. ``"any"``/``"required"``/``True``: some tool (the
    only one, if one is bound). A tool name or ``{"type": "function", "function":
    {"name": ...}}``: that tool; a name no bound tool has is a ``ConfigError``, however
    it is spelt (a string, a dict, through ``.bind``).
    """
    if tool_choice is None or tool_choice is False or tool_choice in ("auto", "none"):
        return None
    name: Any = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = (function.get("name") if isinstance(function, dict) else None) or tool_choice.get("name")
        kind = tool_choice.get("type")
        if name is None and kind in ("auto", "none"):  # Anthropic's spelling of the modes
            return None
        if name is None and kind not in ("any", "required"):
            raise ConfigError(
                "tool_choice",
                "an object must name a tool ({'type': 'function', 'function': {'name': ...}}), "
                f"got {tool_choice!r}",
            )
    elif isinstance(tool_choice, str):
        if tool_choice not in ("any", "required"):
            name = tool_choice
    elif tool_choice is not True:
        raise ConfigError(
            "tool_choice",
            f"must be 'auto', 'none', 'required' (or 'any'), True, a tool name or an object naming one; "
            f"got {tool_choice!r}",
        )
    names = [t["function"]["name"] for t in tools]
    if not names:  # as OpenAI's API: a call cannot be required of a model given no tool
        raise ConfigError("tool_choice", f"{tool_choice!r} requires a tool call, but no tools are bound")
    if name is not None:
        if name not in names:
            raise ConfigError("tool_choice", f"{name!r} names no bound tool; tools: {names}")
        return str(name)
    return names[0] if len(names) == 1 else True


def call_head(name: str, tools: Sequence[dict[str, Any]]) -> str:
    """The start of a call to ``name`` with what its schema fixes already written: the
    arguments object is opened, a tool with exactly one parameter gets that parameter's
    key (and the opening quote when it is a string), and a tool with none gets the whole
    call. The model writes only what the schema leaves open (small models otherwise write
    a bare value where an object belongs, or a number where a string belongs)."""
    schema = next((t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name), {})
    properties = schema.get("properties") or {}
    head = OPEN + json.dumps({"name": name})[:-1] + ', "arguments": '
    if not properties:
        return head + "{}}" + CLOSE
    if len(properties) > 1:
        return head + "{"
    ((key, spec),) = properties.items()
    # a parameter's schema may be a boolean (true: any value): only a string one opens its quote
    string = isinstance(spec, dict) and spec.get("type") == "string"
    return head + json.dumps({key: ""})[:-3] + ('"' if string else "")


_SENTINEL = "\u2063CLM-SYSTEM\u2064"


def template_tools_section(tokenizer: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """What the chat template adds to the system message when given ``tools=``, if it does.

    Found by rendering a sentinel system message with and without the tools: the
    difference, when it is text appended after the system content, is the section.
    ``None`` when the template has no tool support or puts tools elsewhere.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    messages = [{"role": "system", "content": _SENTINEL}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=list(tools), tokenize=False)
    except Exception:  # a template may reject tools or the message shape
        return None
    if plain.count(_SENTINEL) != 1 or with_tools.count(_SENTINEL) != 1:
        return None
    head, tail = plain.split(_SENTINEL)
    tools_head, tools_rest = with_tools.split(_SENTINEL)
    if tools_head != head or not tools_rest.endswith(tail) or len(tools_rest) <= len(tail):
        return None
    section = tools_rest[: len(tools_rest) - len(tail)].strip()
    return section or None
