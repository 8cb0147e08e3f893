#!/usr/bin/env python3
"""Write proto/: the JSON Schema of every wire message, generated from kvxferd.wire.

Run after changing kvxferd/wire.py; tests/test_proto.py fails while proto/ is stale.
(The OpenAPI documents of the engine and peer APIs are added here once those apps exist.)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from pathlib import Path

import msgspec

from kvxferd import wire

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"


def wire_structs() -> list[type[msgspec.Struct]]:
    """Public Struct types of kvxferd.wire, in source order."""
    found = [
        obj
        for name, obj in vars(wire).items()
        if inspect.isclass(obj)
        and issubclass(obj, msgspec.Struct)
        and not name.startswith("_")
        and obj.__module__ == wire.__name__
    ]
    return sorted(found, key=lambda t: inspect.getsourcelines(t)[1])


def render() -> dict[str, str]:
    """Relative path under proto/ -> file text."""
    structs = wire_structs()
    files: dict[str, str] = {}
    _, components = msgspec.json.schema_components(structs, ref_template="#/$defs/{name}")
    _add_field_docs(components)
    for struct in structs:
        name = struct.__name__
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"kvxferd/{name}.json",
            "$ref": f"#/$defs/{name}",
            "$defs": _closure(name, components),
        }
        files[f"schemas/{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    files["schemas/versions.json"] = (
        json.dumps(
            {"manifest_version": wire.MANIFEST_VERSION, "protocol_version": wire.PROTOCOL_VERSION},
            indent=2,
        )
        + "\n"
    )
    return files


def _add_field_docs(components: dict[str, dict]) -> None:
    """Copy each field's attribute docstring in wire.py into its schema ``description``."""
    tree = ast.parse(Path(inspect.getsourcefile(wire) or "").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        props = components.get(cls.name, {}).get("properties", {})
        for node, nxt in zip(cls.body, cls.body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and node.target.id in props
            ):
                props[node.target.id]["description"] = str(nxt.value.value)


def _closure(name: str, components: dict[str, dict]) -> dict[str, dict]:
    """The component ``name`` and every component it references, transitively."""
    seen: dict[str, dict] = {}
    todo = [name]
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen[cur] = components[cur]
        todo.extend(_refs(components[cur]))
    return dict(sorted(seen.items()))


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        out = []
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out.append(value.rsplit("/", 1)[-1])
            else:
                out.extend(_refs(value))
        return out
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if proto/ is out of date")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in render().items():
        path = PROTO / rel
        if not path.exists() or path.read_text() != text:
            stale.append(rel)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if args.check and stale:
        print(f"proto/ is stale ({', '.join(stale)}); run scripts/gen_proto.py", file=sys.stderr)
        return 1
    print(f"{'stale' if stale else 'up to date'}: {len(stale)} file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
