"""Fabric readiness of real sidecars: the self-test READ, the transports UCX chose, and a
sidecar told to require RDMA that refuses readiness on a host without it."""

from __future__ import annotations

import httpx
import pytest

from kvxferd.sidecar.fabric import rdma_devices
from tests.sidecar.harness import EnginePool, plan, start_sidecar

pytestmark = pytest.mark.nixl


def _readyz(peer: str) -> httpx.Response:
    return httpx.get(f"http://{peer}/readyz", timeout=10)


def _registered(s, manifest, pool):
    with s.client() as c:
        c.register(manifest, pool.specs())


def test_ready_after_the_self_test_read_and_names_the_transports(tmp_path):
    s = start_sidecar(str(tmp_path), "fabric")
    m = plan("granite-4.0-h-tiny", num_blocks=4)
    pool = EnginePool(m)
    try:
        assert _readyz(s.peer).status_code == 503  # no engine yet
        _registered(s, m, pool)
        r = _readyz(s.peer)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["self_test"] == "ok"
        assert body["require_transport"] == "any"
        # The loopback agent reached us on this host: cma (or tcp when UCX_TLS says so).
        lanes = body["transports"]["reads"]["intra-node"]
        assert lanes and all(t.split("/")[0] in ("cma", "tcp", "sysv", "posix") for t in lanes)
        metrics = httpx.get(f"http://{s.peer}/metrics", timeout=10).text
        assert 'kvxferd_fabric_transport{endpoint="intra-node",lane="reads"' in metrics
    finally:
        assert s.stop() == 0
        pool.close()


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has an RDMA device")
def test_a_sidecar_that_requires_rdma_is_not_ready_without_it(tmp_path):
    s = start_sidecar(str(tmp_path), "rdma-only", "--require-transport", "rdma")
    m = plan("granite-4.0-h-tiny", num_blocks=4)
    pool = EnginePool(m)
    try:
        _registered(s, m, pool)
        r = _readyz(s.peer)
        assert r.status_code == 503
        body = r.json()
        assert body["error"] == "FabricNotReadyError"
        assert "no RDMA device" in body["detail"]
    finally:
        assert s.stop() == 0
        pool.close()
