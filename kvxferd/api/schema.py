"""JSON Schema of wire Structs, with each field's attribute docstring as its ``description``.

The one place that turns ``kvxferd.wire`` types into schema components: ``proto/schemas/*.json``
(scripts/gen_proto.py) and both OpenAPI documents (kvxferd/api/openapi.py) are built from it.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from kvxferd._docstrings import attribute_docs


def components(types: list[type], ref_template: str) -> dict[str, dict[str, Any]]:
    """Schema components of ``types`` and everything they reference, fields documented.

    ``ref_template`` is where references point, e.g. ``#/$defs/{name}`` for a standalone JSON
    Schema or ``#/components/schemas/{name}`` for OpenAPI.
    """
    _, comps = msgspec.json.schema_components(types, ref_template=ref_template)
    _require_base64(comps)
    by_name = {t.__name__: t for t in _struct_closure(types)}
    for name, comp in comps.items():
        if "description" in comp:
            comp["description"] = inspect.cleandoc(comp["description"])
        cls = by_name.get(name)
        props = comp.get("properties")
        if cls is None or not props:
            continue
        for field, doc in attribute_docs(cls).items():
            if field in props:
                props[field]["description"] = doc
    return comps


BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""What msgspec decodes as ``bytes``: standard base64, padded. ``contentEncoding`` alone only
annotates, so without the pattern a validator (or a fuzzer) takes any string for valid."""


def _require_base64(node: object) -> None:
    """Give every base64 string schema under ``node`` the BASE64 pattern (in place)."""
    if isinstance(node, dict):
        if node.get("contentEncoding") == "base64" and node.get("type") == "string":
            node.setdefault("pattern", BASE64)
        for value in node.values():
            _require_base64(value)
    elif isinstance(node, list):
        for value in node:
            _require_base64(value)


def _struct_closure(types: list[type]) -> list[type]:
    """``types`` and every Struct type reachable through their fields' annotations."""
    seen: dict[type, None] = {}
    todo = list(types)
    while todo:
        cur = todo.pop()
        if cur in seen or not (inspect.isclass(cur) and issubclass(cur, msgspec.Struct)):
            continue
        seen[cur] = None
        for field in msgspec.structs.fields(cur):
            todo.extend(_types_in(field.type))
    return list(seen)


def _types_in(annotation: object) -> list[type]:
    """Classes mentioned anywhere in a (resolved) annotation: ``list[A | B]`` -> [list, A, B]."""
    out: list[type] = []
    if inspect.isclass(annotation):
        out.append(annotation)
    for arg in getattr(annotation, "__args__", ()) or ():
        out.extend(_types_in(arg))
    return out
