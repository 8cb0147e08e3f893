"""Attribute docstrings are read from the source: the string right below each field, bases
included, cleaned like docstrings; a field without one has no entry."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvxferd._docstrings import attribute_docs
from kvxferd.config import Config


class _Base(msgspec.Struct, kw_only=True):
    """A base."""

    inherited: int = 0
    """Comes from the base."""
    shadowed: int = 0
    """The base's words."""


class _Thing(_Base, kw_only=True):
    """A thing."""

    name: str
    """What it is called."""
    undocumented: int = 1
    other: str = ""
    """Documented, after an undocumented one."""
    shadowed: int = 1
    """The subclass's words
        over two lines."""


@dataclass
class _Plain:
    value: int = 0
    """A dataclass field."""
    NOT_A_FIELD = 3
    """An unannotated assignment is not a field."""


def test_reads_the_string_below_each_field_including_bases():
    assert attribute_docs(_Thing) == {
        "inherited": "Comes from the base.",
        "name": "What it is called.",
        "other": "Documented, after an undocumented one.",
        "shadowed": "The subclass's words\nover two lines.",
    }


def test_works_for_any_class_and_skips_unannotated_names():
    assert attribute_docs(_Plain) == {"value": "A dataclass field."}


def test_the_config_and_the_wire_read_the_same_way():
    assert attribute_docs(Config)["peer_port"] == "TCP port of the peer API; 0 picks a free one."
    from kvxferd.wire import Ticket

    assert attribute_docs(Ticket)["hold_id"] == "The hold to claim."
