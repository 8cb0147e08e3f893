"""The sidecar's side of a peer handshake: what it says of itself (its manifest, where each region
lies in its memory, how to reach its agent) and on which fields a reader's handshake disagrees."""

from __future__ import annotations

from kvxferd import descriptors
from kvxferd.transport import Agent, ucxenv
from kvxferd.wire import PROTOCOL_VERSION, Handshake, Manifest, RankLayout


def our_handshake(
    agent: Agent, manifest: Manifest, bases: list[int], *, engine_id: str, epoch: int,
    frames_port: int, generation: int, pod: list[RankLayout] | None = None,
) -> Handshake:  # fmt: skip
    """This sidecar's handshake for the registered ``manifest`` (regions at ``bases``, its
    registration ``generation``; a pod sidecar's ranks 1 up in ``pod``)."""
    return Handshake(
        protocol_version=PROTOCOL_VERSION,
        engine_id=engine_id,
        epoch=epoch,
        agent_name=agent.name,
        agent_metadata=agent.get_agent_metadata(),
        manifest=manifest,
        region_bases=bases,
        frames_port=frames_port,
        tcp_tx_seg_bytes=agent.tcp_segments[0],
        tcp_rx_seg_bytes=agent.tcp_segments[1],
        generation=generation,
        pod=pod or [],
    )


def mismatch(
    ours: Manifest, theirs: Handshake, tx_seg_bytes: int
) -> dict[str, tuple[object, object]]:
    """Fields on which a reader's handshake disagrees with us, ``{field: (ours, theirs)}``
    (empty: compatible): the protocol version alone if it differs, else the manifests and the
    TCP segment sizes (our sends must fit its receives)."""
    if theirs.protocol_version != PROTOCOL_VERSION:
        return {"protocol_version": (PROTOCOL_VERSION, theirs.protocol_version)}
    return {**descriptors.compare_manifests(ours, theirs.manifest), **ucxenv.segment_diff(
        tx_seg_bytes, theirs.tcp_rx_seg_bytes, local="target")}  # fmt: skip


__all__ = ["mismatch", "our_handshake"]
