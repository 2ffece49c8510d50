"""What shape a reply must have: any JSON object, or JSON that validates against a schema.

This is OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``) and LangChain's
``json_mode`` / ``json_schema`` in one value, so every entry point (``Conversation``,
``ChatCLM``, ``clm serve``) hands the same thing to the grammar (``grammar.py``).

Invariants:
- ``schema_json`` is ``None`` (any JSON object) or the ``json.dumps`` text of a JSON
  object, keys in the order given: the value is immutable and hashable, so it can sit
  in frozen settings, and a schema compiles once. Key order is kept, not sorted: the
  grammar writes properties in the schema's declared order.
- A value that is not a format, a schema that is not a JSON object, a ``type`` that
  JSON Schema does not define, or (response formats, not tool parameters) a keyword the
  grammar cannot enforce raises ``ConfigError`` naming the field at construction;
  whatever the grammar compiler rejects beyond that fails before the turn starts
  (``GrammarCompiler.compile``), never halfway through a reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clm_middleware.errors import ConfigError
from clm_middleware.structured.keywords import UNENFORCED, nested_at, unenforced

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANY_OBJECT_TYPES = ("json_object", "json_mode")  # OpenAI's name, LangChain's name


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A reply that is one JSON object (``schema_json`` None) or JSON matching a schema."""

    schema_json: str | None = None
    name: str | None = None  # OpenAI's json_schema.name: reported back, never constrains
    # text the document is wrapped in, (before, after): a tool call's tags (``tool_call``)
    tags: tuple[str, str] | None = None
    # tool calls (``tool_call`` formats) the reply may be instead of the document
    # (``or_calls``): OpenAI's tools with tool_choice auto beside a response_format
    calls: tuple[ResponseFormat, ...] = ()

    @classmethod
    def tool_call(
        cls,
        name: str,
        parameters: Mapping[str, Any] | None,
        tags: tuple[str, str],
        *,
        field: str = "tools.function.parameters",
    ) -> ResponseFormat:
        """A call of tool ``name`` between ``tags``: ``{"name": name, "arguments": ...}``
        with the arguments valid against the tool's ``parameters`` schema (``field`` names
        it in a ``ConfigError``)."""
        arguments = nested_at(parameters or {"type": "object", "properties": {}}, "/properties/arguments")
        arguments.setdefault("type", "object")
        # definitions the parameters refer to ("#/$defs/Address", as pydantic and the openai
        # SDK write them) move to the root, where those references point
        definitions = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
        payload = {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "arguments": arguments},
            "required": ["name", "arguments"],
            **definitions,
        }
        # lenient: a tool validates its own arguments, and a pydantic set field (uniqueItems)
        # must not make a tool unusable; the call is constrained by what the grammar enforces
        checked = cls.from_schema(payload, field=field, enforce_all=False)
        return cls(schema_json=checked.schema_json, tags=tags)

    def or_calls(self, calls: tuple[ResponseFormat, ...]) -> ResponseFormat:
        """This document, or one of ``calls`` (``tool_call`` formats): a model with tools
        it may call (tool_choice auto) answers in this format or calls a tool."""
        return ResponseFormat(self.schema_json, self.name, self.tags, tuple(calls))

    @classmethod
    def json_object(cls) -> ResponseFormat:
        """Any JSON object (OpenAI ``json_object``, LangChain ``json_mode``)."""
        return cls()

    @classmethod
    def from_schema(
        cls,
        schema: Any,
        *,
        name: str | None = None,
        field: str = "response_format.json_schema.schema",
        enforce_all: bool = True,
    ) -> ResponseFormat:
        """The reply must validate against ``schema`` (a JSON Schema as a dict).

        With ``enforce_all`` (every response format), a keyword the grammar would ignore
        (``keywords.UNENFORCED``, an ``allOf`` of several schemas) is a ``ConfigError``
        naming it and where it is: the reply could break it while the format promises a
        valid document."""
        if not isinstance(schema, Mapping):
            raise ConfigError(field, f"must be a JSON schema object, got {type(schema).__name__}")
        _check_types(schema, field)
        ignored = unenforced(schema) if enforce_all else None
        if ignored is not None:
            at, keyword = ignored
            what = UNENFORCED.get(keyword, "a conjunction of several schemas")
            raise ConfigError(
                field,
                f"{keyword!r} at {at or '/'} ({what}) cannot be enforced while generating, so a reply "
                "could break it; remove it from the schema (and check that property in your code)",
            )
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ConfigError(field, f"is not JSON: {error}") from None
        return cls(schema_json=text, name=name)

    @classmethod
    def parse(cls, value: Any, *, field: str = "response_format") -> ResponseFormat | None:
        """``value`` as OpenAI or LangChain spell it; ``None`` and ``{"type": "text"}`` are free text.

        Accepted: a ``ResponseFormat``; ``{"type": "json_object" | "json_mode"}``;
        ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (OpenAI)
        or ``{"type": "json_schema", "schema": {...}}`` (LangChain's ``bind``).
        """
        if value is None or isinstance(value, ResponseFormat):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(field, f"must be a dict with a 'type', got {type(value).__name__}")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind in ANY_OBJECT_TYPES:
            return cls.json_object()
        if kind != "json_schema":
            raise ConfigError(f"{field}.type", f"must be text, json_object or json_schema, got {kind!r}")
        spec = value.get("json_schema")
        if spec is not None:
            if not isinstance(spec, Mapping):
                raise ConfigError(f"{field}.json_schema", "must be an object with a 'schema'")
            schema, name, where = spec.get("schema"), spec.get("name"), f"{field}.json_schema.schema"
        else:
            schema, name, where = value.get("schema"), value.get("name"), f"{field}.schema"
        if schema is None:
            raise ConfigError(where, "required for type json_schema (use json_object for any JSON object)")
        return cls.from_schema(schema, name=None if name is None else str(name), field=where)

    @property
    def is_object(self) -> bool:
        """Whether every document this format admits is a JSON object (a reply may then
        open with ``{``): any object, or a schema whose root says ``"type": "object"``
        (or has ``properties`` and no ``type``), and no tool call instead."""
        if self.calls:
            return False
        schema = self.schema
        return schema is None or schema.get("type", "object" if "properties" in schema else None) == "object"

    @property
    def schema(self) -> dict[str, Any] | None:
        """The schema as a fresh dict (``None``: any JSON object)."""
        return None if self.schema_json is None else json.loads(self.schema_json)

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's spelling of this format."""
        if self.schema_json is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema}}


def _check_types(schema: Mapping[str, Any], field: str) -> None:
    """Every ``type`` in ``schema`` (nested ones too) names JSON types: a typo such as
    ``"strng"`` is a clear error here, not a grammar failure later."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            kind = node.get("type")  # a dict here is a property named "type", not the keyword
            kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
            bad = [k for k in kinds if not isinstance(k, str) or k not in JSON_TYPES]
            if bad:
                raise ConfigError(field, f"unknown type {bad[0]!r}; JSON Schema types are {sorted(JSON_TYPES)}")
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)


def inside_string(text: str) -> bool:
    """Whether JSON ``text`` (a prefix of a document) ends inside a string: an odd number
    of unescaped quotes so far."""
    return open_string_start(text) is not None


def open_string_start(text: str) -> int | None:
    """Where the string JSON ``text`` (a prefix of a document) ends inside begins (just
    after its opening quote); None when it ends outside every string."""
    start: int | None = None
    escaped = False
    for index, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = start is not None
        elif char == '"':
            start = index + 1 if start is None else None
    return start


PHRASE_REPEATS = 3  # a phrase said this many times running inside one string value is a loop
LONGEST_PHRASE = 8  # words
LOOP_WORDS = 6  # the fewest words a phrase loop spans ("very very very" is a phrase, not a loop)
_WORD = re.compile(r"\w+")


def phrase_loop_in_string(text: str) -> bool:
    """Whether JSON ``text`` (a prefix of a document) ends inside a string value whose
    words end with one phrase of at most ``LONGEST_PHRASE`` words said
    ``PHRASE_REPEATS`` times running, over ``LOOP_WORDS`` words at least (``"The movie
    The movie The movie"``, SmolLM2 under a schema until ``max_tokens``): a loop with no
    sentence mark for ``first_repeated_sentence`` to see. Case is ignored. Reads the
    text's last ``_PHRASE_TAIL`` characters, and where they end with such a run, whether
    it lies inside the open string: the turn asks after every token."""
    offset = max(0, len(text) - _PHRASE_TAIL)
    found = list(_WORD.finditer(text, offset))
    words = [match.group().lower() for match in found]
    for period in range(1, LONGEST_PHRASE + 1):
        span = max(period * PHRASE_REPEATS, LOOP_WORDS)
        if len(words) < span:
            break
        tail = words[-span:]
        if all(tail[i] == tail[i - period] for i in range(period, span)):
            start = open_string_start(text)
            return start is not None and start <= found[-span].start()
    return False


_PHRASE_TAIL = 1024  # characters: 24 words (8 × 3) of 40 characters each


LONGEST_NUMBER = 24  # characters: an int64 (19 digits and a sign) or a float's repr fits in fewer
_TRAILING_NUMBER = re.compile(r"-?[0-9][0-9.eE+-]*\Z")


def number_loops(text: str) -> bool:
    """Whether JSON ``text`` (a prefix of a document) ends with a number literal longer
    than ``LONGEST_NUMBER``, outside a string: a digit loop, not a value anyone reads
    (``3333333333...``). Reads only the text's tail (whether it is inside a string only
    then): the turn asks after every token."""
    found = _TRAILING_NUMBER.search(text, max(0, len(text) - 2 * LONGEST_NUMBER))
    return found is not None and len(found.group()) > LONGEST_NUMBER and not inside_string(text)


_TRAILING_DIGITS = re.compile(r"[0-9]+\Z")


def digits_loop_in_string(text: str) -> bool:
    """Whether JSON ``text`` (a prefix of a document) ends inside a string with a run of
    more than ``LONGEST_NUMBER`` digits that repeats itself (some period of at most half
    of it: ``"user_id": "12345678901234567890123456..."``, SmolLM2 on a required tool
    call until ``max_tokens``): a loop, not an id. An id, a card or an account number is
    shorter, and no longer one repeats itself. Reads only the tail, as ``number_loops``."""
    found = _TRAILING_DIGITS.search(text, max(0, len(text) - 4 * LONGEST_NUMBER))
    if found is None or len(found.group()) <= LONGEST_NUMBER:
        return False
    run = found.group()
    return any(run[period:] == run[:-period] for period in range(1, len(run) // 2 + 1)) and inside_string(text)
