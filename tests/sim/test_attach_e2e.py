"""``kvxferd sim --sidecar-socket``: the sim attaches to a ``kvxferd serve`` it did not start
(the Kubernetes pod's own container), waiting for it to come up, registers its pool with it,
serves a request a normal decode sim pulls and verifies, and leaves the sidecar running when it
stops. Wrong socket counts and a sidecar that never answers fail with one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvxferd.errors import ConfigError
from kvxferd.sim.children import Child
from kvxferd.sim.server import SimOptions, run_sim
from tests.sidecar.harness import ReleasedFeed, start_sidecar, wait_until
from tests.sim.procs import PATHS, STUB, TOKEN, Sim, start_sims, text_of

pytestmark = pytest.mark.nixl

POOL = ["--config", "granite-4.0-h-tiny", "--pool-blocks", "12"]  # hybrid: 10 groups
PROMPT = "Attach to the sidecar next door."


def _sim_env() -> dict[str, str]:
    return {**os.environ, "KVXFERD_PEER_TOKEN": TOKEN, "UCX_NET_DEVICES": "lo",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


def test_a_sim_attached_to_a_running_sidecar_serves_a_verified_pull(tmp_path):
    sock = str(tmp_path / "ext.sock")
    # The sim starts first and waits (bounded) for its sidecar, as in a pod.
    attached = Child.spawn(
        "prefill-attached",
        [sys.executable, "-m", "kvxferd", "sim", "--log-level", "warning", "--role", "prefill",
         "--sidecar-socket", sock, "--sidecar-timeout", "120", *POOL],
        env=_sim_env(), merge_stderr=True,
    )  # fmt: skip
    sidecar = decode = None
    try:
        sidecar = start_sidecar(str(tmp_path), "ext", env={"KVXFERD_PEER_TOKEN": TOKEN})
        assert sidecar.socket == sock
        line = attached.wait_line("kvxferd sim ready", 120)
        p = Sim("prefill-attached", line.split("url=", 1)[1].split()[0], attached)
        assert p.get("/health").json() == {"status": "ok", "role": "prefill"}
        decode = start_sims({"decode": ["--role", "decode", "--on-pull-failure", "fail",
                                        *POOL]})["decode"]  # fmt: skip

        resp = p.post(PATHS["completion"], {"prompt": PROMPT, "max_tokens": 1,
                                            "kv_transfer_params": STUB})  # fmt: skip
        assert resp.status_code == 200, resp.text
        params = resp.json()["kv_transfer_params"]
        [ticket] = params["kvxferd_tickets"]
        assert (ticket["peer"], ticket["engine_id"]) == (sidecar.peer, sidecar.engine_id)

        body = {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
        assert len(text_of("completion", decode.post(PATHS["completion"], body)).split()) == 8
        stats = decode.stats()
        assert (stats["pulls_ok"], stats["verified_ok"], stats["verified_failed"]) == (1, 1, 0)
        assert stats["kv_bytes"] > 0 and stats["state_bytes"] > 0
        # The hold lived in the external sidecar and was released by the decode's read.
        feed = ReleasedFeed(sidecar)
        assert feed.wait_for(ticket["hold_id"]) == {ticket["hold_id"]: "notified"}
        wait_until(lambda: p.stats()["holds_outstanding"] == 0, what="prefill blocks back")

        assert attached.stop() == 0
        assert sidecar.child.alive()  # not ours to stop
        with sidecar.client() as c:
            c.healthz()
    finally:
        attached.kill()
        if decode is not None:
            decode.child.stop()
        if sidecar is not None:
            assert sidecar.stop() == 0


def test_a_sidecar_that_never_answers_is_a_one_line_error_after_the_bound(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", "sim", "--role", "decode", "--sidecar-socket",
         str(tmp_path / "nobody.sock"), "--sidecar-timeout", "0.5", *POOL],
        capture_output=True, text=True, timeout=120, env=_sim_env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvxferd: error: --sidecar-socket ")
    assert "nobody.sock: no sidecar answered /healthz within 0.5s" in last


@pytest.mark.parametrize(
    ("role", "tp", "sockets", "message"),
    [
        ("prefill", 2, ("/run/a.sock",), "1 given for --tp 2"),
        ("decode", 2, ("/run/a.sock", "/run/a.sock"), "its own sidecar"),
        ("colocated", 1, ("/run/a.sock",), "colocated"),
    ],
    ids=["count", "shared", "colocated"],
)
def test_wrong_sidecar_sockets_are_refused_before_anything_starts(role, tp, sockets, message):
    opts = SimOptions(role=role, config="no-such-config", tp=tp, sidecar_sockets=sockets)
    with pytest.raises(ConfigError, match=f"^--sidecar-socket: .*{message}"):
        run_sim(opts)  # the bad config name would fail later: nothing else was looked at
