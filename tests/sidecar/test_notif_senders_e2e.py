"""Agent names NIXL cannot decode: a notification whose sender's agent name is not UTF-8 does not
stop a prefill sidecar's notification poller (NIXL's bindings decode sender names, and the batch
read with it is lost: counted), and later readers' notifications still release their holds.

Real prefill and decode ``kvxferd serve`` over NIXL/UCX on loopback, POSIX shm pools. The
stranger is this test's own NIXL agent: the data plane authenticates nothing, so any agent that
has a sidecar's metadata (handshake answers carry it in clear) may notify it under any name.
"""

from __future__ import annotations

import uuid

import httpx
import msgspec
import pytest

from kvxferd.pattern import verify_pattern
from kvxferd.transport import Agent
from kvxferd.wire import PROTOCOL_VERSION, Handshake
from tests.sidecar.harness import Sidecar, metric, peer_signature, wait_until
from tests.sidecar.ranks import DIDS, Engine, engine_pair

pytestmark = pytest.mark.nixl
NOT_UTF8 = b"stranger-\xff\xfe"
"""An agent name NIXL accepts (any bytes) that is no UTF-8."""


def _prefill_handshake(prefill: Sidecar, agent: Agent, engine: Engine) -> Handshake:
    """The prefill's handshake answer (its agent metadata), asked for with a signed call."""
    mine = Handshake(
        protocol_version=PROTOCOL_VERSION, engine_id=f"e{uuid.uuid4().hex[:8]}", epoch=1,
        agent_name="stranger", agent_metadata=agent.get_agent_metadata(),
        manifest=engine.manifest, region_bases=[0] * len(engine.manifest.regions),
        tcp_tx_seg_bytes=agent.tcp_segments[0], tcp_rx_seg_bytes=agent.tcp_segments[1],
    )  # fmt: skip
    raw = msgspec.json.encode(mine)
    headers = {"Authorization": peer_signature(prefill, "POST", "/v1/handshake", raw),
               "Content-Type": "application/json"}  # fmt: skip
    resp = httpx.post(f"http://{prefill.peer}/v1/handshake", content=raw, headers=headers,
                      timeout=30)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return msgspec.json.decode(resp.content, type=Handshake)


def test_a_sender_named_in_no_utf8_is_counted_and_notifications_go_on_releasing(tmp_path):
    with engine_pair(str(tmp_path)) as (p, d):
        stranger = Agent(NOT_UTF8, progress_thread=False)  # type: ignore[arg-type]
        try:
            theirs = _prefill_handshake(p.sidecar, stranger, d)
            stranger.send_notif(stranger.add_remote(theirs.agent_metadata), b"no-such-hold")

            def counted() -> bool:
                stranger.get_notifs()  # progresses our worker: the notification goes out
                return metric(p.sidecar.peer, "kvxferd_notification_polls_failed_total") >= 1

            wait_until(counted, 30, "the prefill's failed notification read counted")
        finally:
            stranger.close()
        # The poller goes on: a pull's notification releases its hold, not its lease's end.
        ticket = p.hold("after-stranger", seed=11)
        status = d.pull([ticket], timeout_s=30)
        assert (status.state, status.reason) == ("done", ""), status
        assert verify_pattern(d.manifest, d.pool.views, DIDS, seed=11) is None
        p.released_once(ticket, "notified")
