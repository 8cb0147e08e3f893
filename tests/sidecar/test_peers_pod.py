"""A pod sidecar's handshake answer: its ranks 1 up (``Handshake.pod``) are checked before any
agent is loaded (ranks 1..N-1 of TP N in order, a base per region each) and adopted as one peer
with a view per rank."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvxferd.errors import HandshakeError
from kvxferd.wire import PROTOCOL_VERSION, Handshake, RankLayout
from tests.sidecar.harness import plan
from tests.sidecar.peertable import answering


def _refused(body: bytes, pattern: str) -> tuple[list[bytes], int]:
    """Handshake with a peer answering ``body``: it must fail with a HandshakeError matching
    ``pattern``; the agents loaded and the peers kept."""

    async def scenario() -> tuple[list[bytes], int]:
        table, loaded = answering(body)
        try:
            with pytest.raises(HandshakeError, match=pattern):
                await table.get("127.0.0.1:1", "e", 1)
            return loaded, len(table)
        finally:
            await table.close()

    return asyncio.run(scenario())


def _their_pod(ranks: int = 2, *, order=None, bases=lambda r, n: [(r + 1) << 30] * n) -> bytes:  # noqa: ANN001
    """A pod sidecar's handshake answer: rank 0 at the top, ranks 1 up in ``pod`` (``order``
    renumbers them, ``bases(rank, regions)`` gives each rank's bases)."""
    manifests = [plan("qwen3-8b", tp_size=ranks, tp_rank=r) for r in (order or range(ranks))]
    layouts = [RankLayout(manifest=m, region_bases=bases(r, len(m.regions)))
               for r, m in enumerate(manifests)]  # fmt: skip
    answer = Handshake(
        protocol_version=PROTOCOL_VERSION, engine_id="e", epoch=1, agent_name="their-agent",
        agent_metadata=b"md", manifest=manifests[0], region_bases=layouts[0].region_bases,
        pod=layouts[1:],
    )  # fmt: skip
    return msgspec.json.encode(answer)


def test_a_pod_answer_is_adopted_as_one_peer_with_every_ranks_layout():
    async def scenario() -> None:
        table, loaded = answering(_their_pod(4))
        try:
            peer = await table.get("127.0.0.1:1", "e", 1)
            assert loaded == [b"md"] and peer.ranks == 4  # one agent for every rank
            for r in range(4):
                view = peer.rank(r)
                assert view.manifest.tp_rank == r and view.agent_name == "their-agent"
                assert set(view.region_bases) == {(r + 1) << 30}
        finally:
            await table.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (_their_pod(4, order=[0, 2, 1, 3]), "pod[0].manifest: rank 2 of 4"),
        (_their_pod(2, bases=lambda r, n: [1 << 30] * (n - r)), "pod[0].region_bases"),
        (_their_pod(2, bases=lambda r, n: [-1 if r else 1 << 30] * n), "pod[0].region_bases[0]"),
    ],
    ids=["ranks-out-of-order", "a-rank-short-of-bases", "a-rank-with-a-negative-base"],
)
def test_a_pod_answer_with_an_unusable_rank_is_a_handshake_error_and_loads_no_agent(body, field):
    loaded, kept = _refused(body, field.replace("[", r"\["))
    assert loaded == [] and kept == 0


def test_a_pod_answer_with_more_ranks_than_its_tp_size_is_a_handshake_error():
    answer = msgspec.json.decode(_their_pod(2))
    answer["pod"] = answer["pod"] * 2  # three layouts for TP 2
    loaded, _ = _refused(msgspec.json.encode(answer), "rank 0 of 2 heads a pod of 3 ranks")
    assert loaded == []
