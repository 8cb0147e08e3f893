"""Schema components carry each field's attribute docstring, inherited fields included."""

from __future__ import annotations

import msgspec

from kvxferd.api.schema import components


class _Base(msgspec.Struct, kw_only=True):
    """A base."""

    inherited: int = 0
    """Comes from the base."""


class _Thing(_Base, kw_only=True):
    """A thing.

    Indented second paragraph.
    """

    name: str
    """What it is called."""
    undocumented: int = 1
    other: str = ""
    """Documented, after an undocumented one."""


class _Holder(msgspec.Struct):
    """Holds things."""

    things: list[_Thing]
    """The things."""


def test_components_describe_fields_of_referenced_structs_too():
    comps = components([_Holder], "#/$defs/{name}")
    assert comps["_Holder"]["properties"]["things"]["description"] == "The things."
    thing = comps["_Thing"]["properties"]
    assert thing["name"]["description"] == "What it is called."
    assert thing["inherited"]["description"] == "Comes from the base."
    assert "description" not in thing["undocumented"]
    assert comps["_Thing"]["description"] == "A thing.\n\nIndented second paragraph."
