"""A sidecar whose store is stuck on a hung disk still exits after SIGTERM, in bounded time.

A real ``kvxferd serve`` with a ``--store-dir``; one of the store's ``<key[:2]>`` subdirectories
is a FUSE mount that stops answering once the store is about to create a file in it, or to
list it (tests/sidecar/hungfs.py): the store's I/O thread then waits in the kernel for good, as
on an NFS whose server went away, and the save that started the write waits for it (a lookup
that lists the directory waits itself). The call (over HTTP or frames) is cancelled once the
shutdown grace (``--shutdown-grace``) has passed, which the store's copies share (the store's
close gets ``CLOSE_MIN_S`` more), and process exit, which would wait for those threads without
end (asyncio's default executor, the interpreter's join of ``concurrent.futures`` workers), ends
them: one line says so and the status is ``EXIT_STORE_STUCK``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable

import pytest

from kvxferd.client import EngineClient
from kvxferd.errors import KvxferdError
from kvxferd.pattern import write_pattern
from kvxferd.sidecar import offload
from kvxferd.store import chunk_keys
from kvxferd.wire import Manifest, StoreLookupRequest, StoreSaveRequest
from tests.sidecar import hungfs
from tests.sidecar.harness import EnginePool, plan, start_sidecar, wait_until
from tests.sidecar.hungfs import HungFs, mountable

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(bool(mountable()), reason=mountable())]

BOUND_S = 30.0  # no other step waits longer
GRACE_S = 1.0  # --shutdown-grace: far below the default, so waits of their own would show
EXIT_BOUND_S = GRACE_S + offload.CLOSE_MIN_S + 10.0  # generous: the teardown takes < 1 s


Call = Callable[[Manifest, list[str]], Callable[[EngineClient], object]]
"""An engine call on the store over a prompt's keys (what it sends, given a client)."""


def _save(manifest: Manifest, keys: list[str]) -> Callable[[EngineClient], object]:
    tokens = len(keys) * manifest.groups[0].block_size
    req = StoreSaveRequest(request_id="r", block_ids=[[1, 2, 3]], keys=keys, num_tokens=tokens)
    return lambda client: client.store_save(req)


def _lookup(manifest: Manifest, keys: list[str]) -> Callable[[EngineClient], object]:
    req = StoreLookupRequest(keys=keys, num_tokens=len(keys) * manifest.groups[0].block_size)
    return lambda client: client.store_lookup(req)


@pytest.mark.parametrize(
    ("call", "frames", "trigger", "shutdown_says"),
    [
        (_save, False, hungfs.creating, "1 store loads or saves still copy"),
        (_save, True, hungfs.creating, "1 store loads or saves still copy"),
        (_lookup, False, hungfs.listing, "1 store lookups did not end"),
    ],
    ids=["save-http", "save-frames", "lookup-http"],
)
def test_a_sidecar_whose_store_call_hangs_on_a_dead_disk_exits_within_its_shutdown_grace(
    tmp_path,
    call: Call,
    frames: bool,
    trigger: hungfs.Trigger,
    shutdown_says: str,
):
    manifest = plan("llama-3.1-8b", num_blocks=8)
    block = manifest.groups[0].block_size
    store_dir = tmp_path / "store"
    pool = EnginePool(manifest)
    sidecar = start_sidecar(str(tmp_path), "hung", "--store-dir", str(store_dir),
                            "--store-chunk-tokens", str(block),
                            "--shutdown-grace", str(GRACE_S))  # fmt: skip
    keys = chunk_keys(list(range(3 * block)), block)  # blocks 1-3, one chunk each
    hung_dir = store_dir / keys[0][:2]  # where the first chunk's file is written (looked up)
    hung_dir.mkdir(mode=0o700)
    try:  # (mounted once the store has started: its start-up scan would list it)
        disk = HungFs(str(hung_dir), trigger)
    except PermissionError as exc:  # root without CAP_SYS_ADMIN (a container)
        sidecar.kill()
        pool.close()
        pytest.skip(f"cannot mount FUSE: {exc}")
    calling: threading.Thread | None = None
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
        write_pattern(manifest, pool.views, [[1, 2, 3]], seed=3)
        send = call(manifest, keys)

        def engine() -> None:  # answered never: the sidecar exits under it
            with pytest.raises(KvxferdError), EngineClient(sidecar.socket, frames=frames) as c:
                send(c)

        calling = threading.Thread(target=engine, daemon=True)
        calling.start()
        assert disk.hung.wait(BOUND_S)  # the store's thread waits in the kernel
        sidecar.child.proc.send_signal(signal.SIGTERM)
        try:
            status = sidecar.child.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvxferd serve still runs {EXIT_BOUND_S:g} s after SIGTERM; its "
                        f"output:\n{sidecar.child.output()}")  # fmt: skip
        assert status == offload.EXIT_STORE_STUCK
        wait_until(lambda: not sidecar.child._pump.is_alive(), BOUND_S, "the sidecar's output")
        out = sidecar.child.output()
        assert shutdown_says in out  # shutdown's own bounded wait gave up on it
        [line] = [ln for ln in out.splitlines() if "still blocked in I/O" in ln]
        assert f"exit status {offload.EXIT_STORE_STUCK}" in line and "kvxferd stopped" in out
        assert not os.path.exists(sidecar.socket)  # it let go of what it could
        calling.join(BOUND_S)
        assert not calling.is_alive()
    finally:
        sidecar.kill()  # (gone already when it passed)
        disk.close()
        pool.close()
