"""Where a JSON schema's subschemas are, and which of its keywords the grammar enforces.

xgrammar 0.2.9 compiles a schema holding ``not``, ``if``/``then``/``else``, an
``allOf`` of two or more schemas, ``uniqueItems``, ``contains`` (and
``minContains``/``maxContains``), ``dependentRequired``, ``dependentSchemas`` or
``dependencies`` without error and without enforcing them: a reply could break them
while the format promises a document valid against the schema. ``unenforced`` finds the
first such keyword so a response format is refused up front, naming it (as vLLM refuses
what its xgrammar backend cannot do). Measured against the library in
``tests/unit/structured/test_schema_keywords.py``.

Invariants:
- ``schema_nodes`` yields every schema position of the document (the root, each
  property's schema, items, branches, definitions, ...), each once, with its JSON
  pointer; the keys of ``properties``, ``$defs`` and the like are names, never read as
  keywords (a property called ``not`` is a property).
- ``for_grammar`` returns a new schema and never changes its argument.
"""

from __future__ import annotations

import copy
import math
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

# keyword -> what a schema holding it would lose under the grammar
UNENFORCED = {
    "not": "a schema a value must not match",
    "if": "a conditional (if/then/else)",
    "uniqueItems": "items that must differ",
    "contains": "an item an array must contain",
    "dependentRequired": "properties required by another's presence",
    "dependentSchemas": "a schema applied by another property's presence",
    "dependencies": "properties required by another's presence",
}
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SINGLE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_LISTED = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # a list of schemas ("items": draft 4 tuples)


def schema_nodes(schema: Mapping[str, Any], pointer: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every subschema of ``schema`` that is an object (``true``/``false`` have no
    keywords), depth first, with its JSON pointer (``""`` is the root)."""
    stack: list[tuple[str, Mapping[str, Any]]] = [(pointer, schema)]
    while stack:
        at, node = stack.pop()
        yield at, node
        children: list[tuple[str, Any]] = []
        for key in _NAMED:
            named = node.get(key)
            if isinstance(named, Mapping):
                children.extend((f"{at}/{_escaped(key)}/{_escaped(str(name))}", sub) for name, sub in named.items())
        for key in _SINGLE:
            children.append((f"{at}/{_escaped(key)}", node.get(key)))
        for key in _LISTED:
            listed = node.get(key)
            if isinstance(listed, list):
                children.extend((f"{at}/{_escaped(key)}/{i}", sub) for i, sub in enumerate(listed))
        stack.extend(reversed([(path, sub) for path, sub in children if isinstance(sub, Mapping)]))


def unenforced(schema: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first keyword of ``schema`` the grammar would ignore, as (JSON pointer of the
    subschema holding it, keyword); ``None`` when every keyword is enforced."""
    for at, node in schema_nodes(schema):
        for keyword in UNENFORCED:
            if keyword == "uniqueItems" and node.get(keyword) is not True:
                continue  # uniqueItems false asks nothing
            if keyword in ("dependentRequired", "dependentSchemas", "dependencies") and not node.get(keyword):
                continue  # an empty map asks nothing
            if keyword in node:
                return at, keyword
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return at, "allOf"
    return None


def for_grammar(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` as the grammar should read it: an object's required name that its
    ``properties`` do not list becomes a listed property, of the schema its
    ``additionalProperties`` gives (any value when that is absent or ``true``). In strict
    mode the grammar writes only listed properties, so it had dropped the requirement: a
    document without the name, invalid against the schema, was allowed. With
    ``additionalProperties: false`` the schema admits no object and is left as it is."""
    result = copy.deepcopy(dict(schema))
    for _, node in schema_nodes(result):
        properties, required = node.get("properties"), node.get("required")
        extra = node.get("additionalProperties", True)
        if not isinstance(properties, dict) or not isinstance(required, list) or extra is False:
            continue
        for name in required:
            if isinstance(name, str) and name not in properties:
                properties[name] = copy.deepcopy(extra) if isinstance(extra, Mapping) else {}
    return result


def nested_at(schema: Mapping[str, Any], pointer: str) -> dict[str, Any]:
    """``schema`` as it must read placed at ``pointer`` inside another schema (a tool's
    parameters under a call's ``/properties/arguments``): a local reference to it
    (``"#"``, ``"#/properties/a"``, as zod writes a repeated schema) points under
    ``pointer``; one into ``$defs`` or ``definitions`` is kept, those move to the new
    root. A draft-4 boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` (OpenAPI 3.0) is
    written as its number, as draft 6 on reads it, and an integer's fractional bounds
    as the whole numbers they admit (``_whole_number_bounds``). Never changes its argument."""
    result = copy.deepcopy(dict(schema))
    for _, node in schema_nodes(result):
        ref = node.get("$ref")
        local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
        if local and not urllib.parse.unquote(ref).startswith(("#/$defs/", "#/definitions/")):
            node["$ref"] = "#" + pointer + ref[1:]  # type: ignore[index]
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(exclusive), bool):
                flag = node.pop(exclusive)  # type: ignore[attr-defined]
                if flag and bound in node:
                    node[exclusive] = node.pop(bound)  # type: ignore[index,attr-defined]
        _whole_number_bounds(node)
    return result


def _whole_number_bounds(node: Any) -> None:
    """An integer's fractional bounds as the whole numbers they admit, as the grammar
    needs them: ``minimum`` 0.5 is 1, ``exclusiveMinimum`` 0.5 is ``minimum`` 1,
    ``exclusiveMaximum`` 2.5 is ``maximum`` 2 (a type list of ``integer`` and ``null``
    too; one with ``number`` admits fractions and is left as it is)."""
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if "integer" not in kinds or "number" in kinds:
        return
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = node.get(exclusive)
        if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
            del node[exclusive]  # > 0.5 is >= 1 among integers, < 2.5 is <= 2: the bound rounded below
            other = node.get(bound)
            node[bound] = (
                value if not isinstance(other, int | float) else (max if bound == "minimum" else min)(value, other)
            )
    for bound, rounded in (("minimum", math.ceil), ("maximum", math.floor)):
        value = node.get(bound)
        if isinstance(value, float) and math.isfinite(value):
            node[bound] = rounded(value)


def without_patterns(schema: Any) -> Any:
    """``schema`` with every ``pattern`` keyword left out (a property named "pattern"
    stays): for a regular expression the grammar engine cannot hold, checked by the
    tool itself. Never changes its argument."""
    if not isinstance(schema, Mapping):
        return schema
    result = copy.deepcopy(dict(schema))
    for _, node in schema_nodes(result):
        if isinstance(node.get("pattern"), str):
            del node["pattern"]  # type: ignore[attr-defined]
    return result


def _escaped(token: str) -> str:
    """``token`` as one JSON pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")
