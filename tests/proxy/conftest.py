"""The ``make_rig`` fixture of the proxy tests (tests.proxy.rig)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.proxy.rig import Rig, rig_maker


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    yield from rig_maker()
