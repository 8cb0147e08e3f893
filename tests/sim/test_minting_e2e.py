"""A prefill sim mints its tickets itself, as the vLLM connector's scheduler does: from its
second request on it answers at once and places the holds after. It does so only with its
sidecars' own secret, and a hold it then fails to place is given up on every rank, so the
decode holding its tickets ends at once and the prefill's blocks come back. Real sims and
sidecars, bytes verified by the decode."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from kvxferd.sim.children import Child
from tests.sidecar.harness import Sidecar, start_sidecar, wait_until
from tests.sim.procs import PATHS, STUB, TOKEN, Sim, running_sims, text_of

pytestmark = pytest.mark.nixl

POOL = ["--config", "granite-4.0-h-tiny", "--pool-blocks", "24"]  # hybrid: 10 groups
BOUND_S = 60.0


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, Sim]]:
    with running_sims({
        "prefill_tp2": ["--role", "prefill", "--tp", "2", *POOL],
        "decode": ["--role", "decode", "--on-pull-failure", "fail", *POOL],
        "decode_recompute": ["--role", "decode", *POOL],
        "colocated": ["--role", "colocated", *POOL],
    }) as procs:  # fmt: skip
        yield procs


def _prefill(p: Sim, prompt: str) -> dict:
    resp = p.post(PATHS["completion"], {"prompt": prompt, "max_tokens": 1,
                                        "kv_transfer_params": STUB})  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _text(sim: Sim, prompt: str, params: dict | None = None) -> str:
    body: dict = {"prompt": prompt, "max_tokens": 6}
    if params is not None:
        body["kv_transfer_params"] = params
    resp = sim.post(PATHS["completion"], body)
    assert resp.status_code == 200, resp.text
    return text_of("completion", resp)


def _all_free(sim: Sim) -> bool:
    s = sim.stats()
    return s["blocks_free"] == s["blocks_total"] and s["holds_outstanding"] == 0


def test_from_its_second_request_a_prefill_answers_with_tickets_it_minted(sims):
    p, d, c = sims["prefill_tp2"], sims["decode"], sims["colocated"]
    before = p.stats()
    first = _prefill(p, "Held first, so the sim learns how its sidecars sign.")
    assert p.stats()["tickets_minted"] == before["tickets_minted"]
    for i in range(3):
        prompt = f"Minted here, held after the answer: request {i}."
        params = _prefill(p, prompt)
        tickets = params["kvxferd_tickets"]
        assert len(tickets) == 2 and tickets[0]["hold_id"] == tickets[1]["hold_id"]
        assert _text(d, prompt, params) == _text(c, prompt)
        # Its blocks come back once the read's notification reached the prefill (after the
        # decode answered): the pool holds ``first`` and one more request, not two more.
        released = before["holds_released"] + i + 1
        wait_until(lambda: p.stats()["holds_released"] >= released, BOUND_S,  # noqa: B023
                   f"request {i}'s hold released")  # fmt: skip
    assert p.stats()["tickets_minted"] == before["tickets_minted"] + 3
    prompt = "Held first, so the sim learns how its sidecars sign."
    assert _text(d, prompt, first) == _text(c, prompt)
    stats = d.stats()
    assert stats["verified_failed"] == 0 and stats["pulls_failed"] == 0
    wait_until(lambda: _all_free(p), BOUND_S, "the prefill's blocks back after the reads")
    after = p.stats()
    assert after["holds_released"] == before["holds_released"] + 4
    assert after["holds_failed"] == before["holds_failed"] == 0


def _attached(sock: str, token: str) -> tuple[Child, Sim]:
    env = {**os.environ, "KVXFERD_PEER_TOKEN": token, "UCX_NET_DEVICES": "lo",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    child = Child.spawn(
        "prefill-attached",
        [sys.executable, "-m", "kvxferd", "sim", "--log-level", "warning", "--role", "prefill",
         "--lease", "600", "--sidecar-socket", sock, "--sidecar-timeout", "120", *POOL],
        env=env, merge_stderr=True,
    )  # fmt: skip
    line = child.wait_line("kvxferd sim ready", 120)
    return child, Sim("prefill-attached", line.split("url=", 1)[1].split()[0], child)


@pytest.fixture
def sidecar(tmp_path) -> Iterator[Sidecar]:
    """An external sidecar (the pod's own container) that takes one hold at a time."""
    side = start_sidecar(str(tmp_path), "ext", "--max-holds", "1", "--max-lease", "600",
                         env={"KVXFERD_PEER_TOKEN": TOKEN})  # fmt: skip
    yield side
    side.stop()


def test_a_prefill_that_does_not_know_its_sidecars_secret_holds_first_every_time(sims, sidecar):
    child, p = _attached(sidecar.socket, "not-the-sidecars-secret")
    try:
        for i in range(2):
            prompt = f"Held before the answer, every time: request {i}."
            params = _prefill(p, prompt)
            assert _text(sims["decode"], prompt, params) == _text(sims["colocated"], prompt)
            wait_until(lambda: _all_free(p), BOUND_S, "the hold to end (one at a time)")
        assert p.stats()["tickets_minted"] == 0
        assert "another secret than KVXFERD_PEER_TOKEN" in child.output()
    finally:
        child.kill()


def test_a_minted_hold_its_sidecar_refuses_is_given_up_and_its_decode_recomputes(sims, sidecar):
    child, p = _attached(sidecar.socket, TOKEN)
    d = sims["decode_recompute"]
    try:
        held = _prefill(p, "The first request holds the sidecar's only hold.")
        before = d.stats()
        prompt = "Minted, but the sidecar has no room for its hold."
        refused = _prefill(p, prompt)  # answered before its hold was placed
        assert p.stats()["tickets_minted"] == 1
        wait_until(lambda: p.stats()["holds_failed"] == 1, BOUND_S, "the placement to fail")
        assert p.stats()["holds_outstanding"] == 1  # its blocks came back at once
        assert _text(d, prompt, refused) == _text(sims["colocated"], prompt)
        after = d.stats()
        assert after["recomputed"] == before["recomputed"] + 1
        assert after["pulls_failed"] == before["pulls_failed"] + 1
        # The sim holds first again (it learns anew), and the held request still pulls.
        prompt = "The first request holds the sidecar's only hold."
        assert _text(d, prompt, held) == _text(sims["colocated"], prompt)
        wait_until(lambda: _all_free(p), BOUND_S, "the prefill's blocks back")
        assert d.stats()["pulls_ok"] == after["pulls_ok"] + 1
    finally:
        child.kill()
