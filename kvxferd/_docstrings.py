"""Attribute docstrings: the string literal written right below a class attribute.

Layer 0 (standard library only), so the config (``--help``, the operations doc) and the wire
schema (``proto/``, OpenAPI field descriptions) read their field documentation the same way.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written right below it in ``cls``'s body (and bases'),
    cleaned like a docstring (``inspect.cleandoc``); a subclass's string wins."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ in ("builtins", "msgspec"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs
