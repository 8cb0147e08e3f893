"""The NIXL agent and its transfers implement the transport seam the sidecar relies on."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.transport import PostedRead, Transport

pytestmark = pytest.mark.nixl


def test_the_agent_is_a_transport_and_its_reads_are_posted_reads(agent, peer, dst):
    assert isinstance(agent, Transport)
    agent.add_remote(peer.metadata)
    with agent.read(peer.name, np.array([[dst.base_addr, 4096]]),
                    np.array([[peer.remote_base, 4096]])) as xfer:  # fmt: skip
        assert isinstance(xfer, PostedRead)
        xfer.wait(30)
    assert agent.live_handles().transfers == 0


def test_something_missing_a_verb_is_not_a_transport():
    class NoPoll:
        name = "x"

        def read(self, *a: object) -> None: ...

    assert not isinstance(NoPoll(), Transport)
