"""One line from a pydantic `ValidationError`: the field, its value and what is valid.

trainplan's file formats are each declared once, as a strict pydantic model beside the format's
reader: a plan (`trainplan.planner.plan_schema`), a hardware profile (`trainplan.hardware_profiles.profile_schema`)
and a held-out curve (`trainplan.costmodels.stopping.heldout_curve.HeldoutCurveSchema`). Why pydantic: its
strict mode refuses what a hand check forgot (`true` for a number, `8.0` for a whole number,
`NaN`), the same declaration gives the published JSON Schema (`docs/schemas/`), and the
constraints live in one place instead of `isinstance` guards in every reader. A reader turns the
`ValidationError` into the project's typed error with `one_line`, whose text is read off the
model's JSON Schema, e.g. `decisions.seq_len='abc' must be a whole number >= 1`.

Messages a validator raises itself (a `ValueError` in a model or field validator) are kept:
one that starts with "must" follows the field's name and value, any other stands alone.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["one_line"]

_SHORT = 80
"""Longest value shown in a message, characters (a longer one is cut with '...')."""


def one_line(err: ValidationError, model: type[BaseModel], *, name: str = "") -> str:
    """The first problem `err` reports, as one line naming the field (dotted, `[i]` for list
    items, `name.` before it when given), its value and what is valid: unknown keys first (with
    the valid ones), then missing keys, then the first other error."""
    errors = err.errors(include_url=False)
    schema = _schema(model)
    for kind, what in (("extra_forbidden", "unknown"), ("missing", "missing")):
        group = [e for e in errors if e["type"] == kind and (not e["loc"] or not isinstance(e["loc"][-1], int))]
        if group:
            parent = group[0]["loc"][:-1]
            keys = [str(e["loc"][-1]) for e in group if e["loc"][:-1] == parent]
            where, node = _walk(schema, parent)
            text = f"{what} key(s) {', '.join(keys)}"
            if kind == "extra_forbidden" and "properties" in node:
                text += f"; valid keys are {', '.join(node['properties'])}"
            return f"{_path(name, where)}: {text}" if where else text
    e = errors[0]
    loc = e["loc"][:-1] if e["type"] == "missing" else e["loc"]  # a tuple too short: the tuple
    where, node = _walk(schema, loc)
    field = _path(name, where)
    sep = " " if field.endswith(" key") else "="
    value = f"{field}{sep}{_show(e['input'])}" if field else _show(e["input"])
    if e["type"] in ("value_error", "assertion_error"):
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{value} {msg}" if msg.startswith("must") else msg
    return f"{value} must be {_describe(node, schema.get('$defs', {}))}"


@functools.cache
def _schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _walk(schema: dict[str, Any], loc: tuple) -> tuple[list[str], dict[str, Any]]:
    """The displayed path of `loc` and the schema node it points to. Parts that name no level of
    the schema (pydantic's union member tags) are skipped; a key that is itself invalid (`loc`
    ending in the key and "[key]") ends the path in " key"."""
    defs = schema.get("$defs", {})
    node, where = schema, []
    parts = list(loc)
    for i, part in enumerate(parts):
        node = _resolve(node, defs)
        if "anyOf" in node:  # e.g. a number or null: the branch that has the next level
            node = next((_resolve(b, defs) for b in node["anyOf"] if b.get("type") != "null"), node)
        if part == "[key]":
            continue
        if isinstance(part, int):
            items = node.get("prefixItems")
            node = items[part] if items and part < len(items) else node.get("items", {})
            where.append(f"[{part}]")
        elif i + 1 < len(parts) and parts[i + 1] == "[key]":
            pattern = next(iter(node.get("patternProperties", {})), None)
            node = node.get("propertyNames") or {"type": "string", **({"pattern": pattern} if pattern else {})}
            where.append(" key")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
            where.append(part)
        elif "additionalProperties" in node or "patternProperties" in node:
            extra = node.get("additionalProperties")
            node = extra if isinstance(extra, dict) else next(iter(node.get("patternProperties", {}).values()), {})
            where.append(part)
    return where, _resolve(node, defs)


def _path(name: str, where: list[str]) -> str:
    out = name
    for part in where:
        out += part if part.startswith(("[", " ")) or not out else f".{part}"
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."


def _num(v: float) -> str:
    if isinstance(v, int) and v >= 2**32 and v & (v - 1) == 0:  # 2^63, not 9223372036854775808
        return f"2^{v.bit_length() - 1}"
    return str(v) if isinstance(v, int) else f"{v:g}"


def _range(node: dict[str, Any]) -> str:
    lo = ("[", node["minimum"]) if "minimum" in node else ("(", node.get("exclusiveMinimum"))
    hi = ("]", node["maximum"]) if "maximum" in node else (")", node.get("exclusiveMaximum"))
    if lo[1] is not None and hi[1] is not None:
        return f" in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo[1] is not None:
        return f" {'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi[1] is not None:
        return f" {'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _choices(values: list) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def _describe(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """What `node` (a JSON Schema) accepts, as a noun phrase: "a whole number >= 1"."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        return " or ".join(_describe(b, defs) for b in node["anyOf"])
    if "enum" in node:
        return _choices(node["enum"])
    if "const" in node:
        return str(node["const"])
    kind = node.get("type")
    if kind == "null":
        return "null"
    if kind == "boolean":
        return "true or false"
    if kind == "integer":
        return "a whole number" + _range(node)
    if kind == "number":
        return "a finite number" + _range(node)
    if kind == "string":
        if "pattern" in node:
            return f"a string matching {node['pattern']}"
        return "a non-empty string" if node.get("minLength", 0) > 0 else "a string"
    if kind == "array":
        return _describe_array(node, defs)
    if kind == "object":
        if node.get("properties"):
            return f"an object with keys {', '.join(node['properties'])}"
        values = node.get("additionalProperties")
        if not isinstance(values, dict):
            values = next(iter(node.get("patternProperties", {}).values()), None)
        inner = f" with {_describe(values, defs)} per key" if values else ""
        return ("a non-empty object" if node.get("minProperties", 0) > 0 else "an object") + inner
    return "a valid value"


def _describe_array(node: dict[str, Any], defs: dict[str, Any]) -> str:
    if "prefixItems" in node:
        parts = [_describe(p, defs) for p in node["prefixItems"]]
        return f"a list [{', '.join(parts)}]"
    items = _resolve(node.get("items", {}), defs)
    head = "a non-empty list" if node.get("minItems", 0) > 0 else "a list"
    if items.get("type") == "string" and len(items) <= 2:  # type (and title) only
        return f"{head} of strings"
    if not items:
        return head
    return f"{head}, each item {_describe(items, defs)}"

