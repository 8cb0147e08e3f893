"""Claims over the framed peer port between real sidecars (NIXL over loopback): a prefill names
its framed port in the handshake and the decode claims there; a prefill with the port off, or a
port that cannot be opened, gets its claims over HTTP. Every pull moves every byte either way."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.peers import Peer, PeerTable
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.wire import ClaimRequest, HoldRequest, PullRequest
from tests.sidecar.harness import TOKEN, EnginePool, metric, plan, start_sidecar, wait_until

pytestmark = pytest.mark.nixl

SRC, DST = [[1, 2, 3]], [[4, 5, 6]]


def _pull_three(p, d, pm, dm, ppool, dpool) -> None:  # noqa: ANN001
    """Three pulls of three blocks, each checked byte for byte."""
    with p.client() as pc, d.client() as dc:
        for i in range(3):
            write_pattern(pm, ppool.views, SRC, seed=40 + i)
            ticket = pc.hold(HoldRequest(request_id=f"r{i}", block_ids=SRC, num_tokens=40))
            pull = dc.pull(PullRequest(tickets=[ticket], block_ids=DST, deadline_s=30))
            status = dc.wait_pull(pull.pull_id, timeout_s=60)
            assert status.state == "done", status
            assert verify_pattern(dm, dpool.views, DST, seed=40 + i) is None


def _pair(tmp_path, env: dict[str, str]):  # noqa: ANN001, ANN202
    """A prefill sidecar (``env``) and a decode one, each with a registered 8-block pool."""
    p = start_sidecar(str(tmp_path), "prefill", env=env)
    d = start_sidecar(str(tmp_path), "decode")
    pm, dm = plan("llama-3.1-8b", num_blocks=8), plan("llama-3.1-8b", num_blocks=8)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    with p.client() as pc, d.client() as dc:
        pc.register(pm, ppool.specs())
        dc.register(dm, dpool.specs())
    return p, d, pm, dm, ppool, dpool


def _claims(d) -> tuple[float, float]:  # noqa: ANN001
    """The decode's claims so far: (over frames, over HTTP)."""
    return tuple(metric(d.peer, "kvxferd_peer_calls_total", call="claim", wire=wire)
                 for wire in ("frames", "http"))  # type: ignore[return-value]  # fmt: skip


@pytest.mark.parametrize("frames_port", ["0", "-1"], ids=["framed", "framed-port-off"])
def test_claims_go_framed_where_the_prefill_serves_frames_and_over_http_otherwise(
    tmp_path, frames_port
):
    p, d, pm, dm, ppool, dpool = _pair(tmp_path, {"KVXFERD_PEER_FRAMES_PORT": frames_port})
    try:
        _pull_three(p, d, pm, dm, ppool, dpool)
        assert _claims(d) == ((3.0, 0.0) if frames_port == "0" else (0.0, 3.0))
        assert metric(p.peer, "kvxferd_holds_released_total", reason="notified") == 3
    finally:
        for s in (p, d):
            assert s.stop() == 0
        ppool.close()
        dpool.close()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_framed_port_that_cannot_be_opened_sends_claims_over_http_until_the_next_handshake(
    tmp_path,
):
    """Nothing was sent on it, so the claim goes over HTTP at once and is granted once."""
    p = start_sidecar(str(tmp_path), "prefill")
    pm = plan("llama-3.1-8b", num_blocks=8)
    ppool = EnginePool(pm)
    calls: list[tuple[str, str]] = []

    async def scenario() -> tuple[list, bool, bool]:
        async def no_agent(_: object) -> str:
            return "unused"

        async def nothing(_: object) -> None:
            return None

        table = PeerTable(
            local_handshake=lambda: None,  # type: ignore[arg-type,return-value]
            add_agent=no_agent, remove_agent=nothing, check_compatible=lambda _: {},
            keys=PeerKeys.of(TOKEN), timeout_s=10.0,
            on_call=lambda call, wire: calls.append((call, wire)),
        )  # fmt: skip
        peer = Peer(address=p.peer, engine_id=p.engine_id, epoch=p.epoch, agent_name="x",
                    manifest=pm, region_bases=(), frames_port=_closed_port())  # fmt: skip
        table._adopt(p.peer, peer)
        try:
            grants = []
            for i in range(2):
                ticket = pc.hold(HoldRequest(request_id=f"c{i}", block_ids=SRC, num_tokens=40))
                req = ClaimRequest(ticket=ticket, reader="reader", reader_tp_size=1, claim_s=5.0)
                grants.append(await table.claim(p.peer, req))
            http_only = p.peer in table._http_only
            table._adopt(p.peer, peer)  # a new handshake: the framed port is tried again
            return grants, http_only, p.peer in table._http_only
        finally:
            await table.close()

    try:
        with p.client() as pc:
            pc.register(pm, ppool.specs())
            grants, http_only, after_handshake = asyncio.run(scenario())
        assert [g.expected_readers for g in grants] == [1, 1]
        assert calls == [("claim", "http"), ("claim", "http")]
        assert http_only and not after_handshake
    finally:
        assert p.stop() == 0
        ppool.close()


def _closed_at_once(port: int) -> bool:
    """Whether the framed port closes a new connection before it sends anything (at its cap)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        try:
            return s.recv(1) == b""
        except TimeoutError:  # kept open: below its cap
            return False


def test_a_framed_port_at_its_connection_cap_gets_each_claim_over_http_granted_once(tmp_path):
    """The prefill's framed port holds its cap of connections (two idle ones here, its
    peer_max_connections 2): it closes the decode's claim connection unread (FrameRefusedError),
    nothing taken, and each claim goes over HTTP instead. Every pull moves every byte, and each
    hold is released by its one reader's one notification: no claim was counted twice."""
    port = _closed_port()
    env = {"KVXFERD_PEER_FRAMES_PORT": str(port), "KVXFERD_PEER_MAX_CONNECTIONS": "2"}
    p, d, pm, dm, ppool, dpool = _pair(tmp_path, env)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(2)]
    try:
        wait_until(lambda: _closed_at_once(port), what="the framed port at its cap")
        _pull_three(p, d, pm, dm, ppool, dpool)
        assert _claims(d) == (0.0, 3.0)
        assert metric(p.peer, "kvxferd_holds_released_total", reason="notified") == 3
    finally:
        for s in idle:
            s.close()
        for s in (p, d):
            assert s.stop() == 0
        ppool.close()
        dpool.close()
