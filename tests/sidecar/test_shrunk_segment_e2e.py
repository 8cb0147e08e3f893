"""The sidecar survives an engine truncating a registered shared-memory segment.

Past a segment's new end its pages are gone: a sidecar touching them through its mapping (a
store copy, or its UCX worker copying a READ over TCP) dies of SIGBUS. Each test registers a
real segment with ``kvxferd serve``, truncates it as a misbehaving engine would, drives one
operation, and checks the operation failed with the typed reason while the sidecar still
answers (and exits cleanly). The test process never touches its own truncated mapping either.
"""

from __future__ import annotations

import os

import httpx
import pytest

from kvxferd.errors import SegmentTooSmallError
from kvxferd.memory import SHM_DIR
from kvxferd.pattern import write_pattern
from kvxferd.store import chunk_keys
from kvxferd.wire import HoldRequest, PullRequest, StoreLoadRequest, StoreSaveRequest
from tests.sidecar.harness import EnginePool, plan, start_sidecar
from tests.store.helpers import DENSE, block_ids

pytestmark = pytest.mark.nixl
TOKENS, CHUNK = 40, 16
KEYS = chunk_keys(list(range(TOKENS)), CHUNK)
FIELD = "regions[0].size_bytes"
TCP = {"UCX_TLS": "tcp"}
"""READs over UCX's TCP transport, whose workers copy READ data in user space (over CMA, the
loopback default, the kernel copies and a missing page is an error, not a signal)."""


def _truncate(pool: EnginePool) -> None:
    """Shrink every segment of ``pool`` to nothing, as an engine's ftruncate would."""
    for spec in pool.specs():
        os.truncate(os.path.join(SHM_DIR, spec.name), 0)


def _assert_serving_but_not_ready(sidecar) -> None:  # noqa: ANN001
    """The sidecar answers, and /readyz says which registered segment shrank."""
    with sidecar.client() as client:
        assert client.identity().engine_id == sidecar.engine_id
    ready = httpx.get(f"http://{sidecar.peer}/readyz", timeout=10)
    assert ready.status_code == 503 and FIELD in ready.json()["detail"], ready.text


def _store(tmp_path, name: str):  # noqa: ANN001, ANN202
    return start_sidecar(str(tmp_path), name, "--store-dir", str(tmp_path / "store"),
                         "--store-chunk-tokens", str(CHUNK))  # fmt: skip


def test_a_store_save_from_a_truncated_segment_fails_naming_it_until_registered_again(tmp_path):
    manifest, whole = plan(DENSE, num_blocks=8), plan(DENSE, num_blocks=8)
    pool, fresh = EnginePool(manifest), EnginePool(whole)
    ids = block_ids(manifest, TOKENS, descending=True)
    save = StoreSaveRequest(request_id="r", block_ids=ids, keys=KEYS, num_tokens=TOKENS)
    sidecar = _store(tmp_path, "saver")
    try:
        with sidecar.client() as client:
            registered = client.register(manifest, pool.specs())
            _truncate(pool)
            with pytest.raises(SegmentTooSmallError) as err:
                client.store_save(save)
            assert err.value.field == FIELD
            _assert_serving_but_not_ready(sidecar)
            with pytest.raises(SegmentTooSmallError) as hold:  # nor can its blocks be read
                client.hold(HoldRequest(request_id="h", block_ids=ids, num_tokens=TOKENS))
            assert hold.value.field == FIELD
            client.unregister(registered.generation)  # the engine starts over, whole
            client.register(whole, fresh.specs())
            assert httpx.get(f"http://{sidecar.peer}/readyz", timeout=10).status_code == 200
            assert client.store_save(save).chunks_saved > 0
    finally:
        code = sidecar.stop()
        pool.close()
        fresh.close()
    assert code == 0  # not killed by SIGBUS (-7)


def test_a_store_load_into_a_truncated_segment_fails_segment_too_small(tmp_path):
    manifest = plan(DENSE, num_blocks=8)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, TOKENS, descending=True)
    sidecar = _store(tmp_path, "loader")
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            saved = client.store_save(
                StoreSaveRequest(request_id="r", block_ids=ids, keys=KEYS, num_tokens=TOKENS)
            )
            assert saved.chunks_saved > 0
            _truncate(pool)
            status = client.store_load(StoreLoadRequest(keys=KEYS, block_ids=ids,
                                                        num_tokens=TOKENS))  # fmt: skip
            assert (status.state, status.reason) == ("failed", "segment_too_small")
            assert FIELD in status.detail
        _assert_serving_but_not_ready(sidecar)
    finally:
        code = sidecar.stop()
        pool.close()
    assert code == 0


@pytest.mark.parametrize(
    ("shrunk", "env"), [("decode", TCP), ("prefill", {})], ids=["into-decode-tcp", "from-prefill"]
)
def test_a_pull_touching_a_truncated_segment_fails_segment_too_small(tmp_path, shrunk, env):
    """The decode checks its memory right before posting READs into it (over TCP its own UCX
    worker would copy into the missing pages); the prefill refuses the claim."""
    pm, dm = plan(DENSE, num_blocks=8), plan(DENSE, num_blocks=8)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    p = start_sidecar(str(tmp_path), "prefill", env=env)
    d = start_sidecar(str(tmp_path), "decode", env=env)
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            pids = block_ids(pm, TOKENS, descending=True)
            write_pattern(pm, ppool.views, pids, seed=3)
            ticket = pc.hold(HoldRequest(request_id="r", block_ids=pids, num_tokens=TOKENS))
            _truncate(dpool if shrunk == "decode" else ppool)
            pull = dc.pull(PullRequest(tickets=[ticket], block_ids=block_ids(dm, TOKENS),
                                       deadline_s=30))  # fmt: skip
            status = dc.wait_pull(pull.pull_id, timeout_s=60)
            assert (status.state, status.reason) == ("failed", "segment_too_small"), status
            assert FIELD in status.detail
        _assert_serving_but_not_ready(d if shrunk == "decode" else p)
    finally:
        codes = (p.stop(), d.stop())
        ppool.close()
        dpool.close()
    assert codes == (0, 0)
