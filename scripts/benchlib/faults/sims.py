"""The sim-level target: a prefill and a decode ``kvxferd sim`` (each with its own sidecar), the
campaign acting as the proxy, so it sees the transfer params and can forge them.

Faults here: kill -9 or SIGSTOP of either sim (with its sidecars) in the middle of a request,
restart on the same port, and a forged ticket posted to the decode's OpenAI port (the attack of
issue 10). Checks: the decode answers within its bound, never with bytes it could not verify
(``verified_failed``), the prefill's holds drain, both sims answer ``/health``.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from typing import Any

import httpx

from kvxferd.sim.children import Child

from . import osproc
from .bodies import Target
from .context import Ctx

LEASE_S = 4.0
PULL_TIMEOUT_S = 5.0
REQUEST_BOUND_S = PULL_TIMEOUT_S + 15.0 + 10.0
"""The decode's pull timeout, its settle time (kvxferd.sim.pulls.SETTLE_S) and slack."""
HOLDS_DRAIN_S = LEASE_S + 8.0
STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
    "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi",
]  # fmt: skip


class SimNode:
    """One ``kvxferd sim``, restartable on the same port."""

    def __init__(self, role: str, config: str, env: dict[str, str]) -> None:
        self.role = role
        self.config = config
        self.env = env
        self.port = 0
        self.child: Child | None = None
        self.url = ""
        self.model = ""

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "kvxferd", "sim", "--role", self.role, "--config", self.config,
             "--pool-blocks", "512", "--host", "127.0.0.1", "--port", str(self.port),
             "--lease", str(LEASE_S), "--pull-timeout", str(PULL_TIMEOUT_S),
             "--log-level", "warning"]  # fmt: skip
        return a + (["--on-pull-failure", "fail"] if self.role == "decode" else [])

    def start(self) -> None:
        last: Exception | None = None
        for _ in range(5):
            self.child = Child.spawn(f"{self.role} sim", self.argv(), env=self.env,
                                     merge_stderr=True, die_with_parent=True)  # fmt: skip
            try:
                line = self.child.wait_line("kvxferd sim ready", 120.0)
            except Exception as exc:  # noqa: BLE001 - the port may linger after a kill: retry
                last = exc
                time.sleep(0.5)
                continue
            fields = dict(kv.split("=", 1) for kv in line.split()[3:] if "=" in kv)
            self.url, self.model = fields["url"], fields.get("model", "")
            self.port = int(self.url.rsplit(":", 1)[1])
            return
        assert last is not None
        raise last

    def pids(self) -> list[int]:
        return osproc.tree(self.child.pid) if self.child else []

    def kill(self) -> None:
        """SIGKILL the sim and its sidecars (they would die with it anyway)."""
        pids = self.pids()
        osproc.cont(pids)
        if self.child is not None:
            self.child.kill()
        osproc.signal_tree(pids[1:], 9)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.child is not None:
            osproc.cont(self.pids())
            self.child.stop(20.0)

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/v1/stats", timeout=5.0).json()

    def problem(self) -> str:
        if self.child is None or not self.child.alive():
            return f"{self.role} sim exited"
        try:
            httpx.get(self.url + "/health", timeout=5.0).raise_for_status()
        except Exception as exc:  # noqa: BLE001
            return f"{self.role} sim /health: {exc!r}"[:200]
        return ""


class Sims:
    """The two sims and the requests the campaign drives through them."""

    def __init__(self, config: str, env: dict[str, str], rng: random.Random) -> None:
        self.p = SimNode("prefill", config, env)
        self.d = SimNode("decode", config, env)
        self.rng = rng
        self._verified_failed = 0

    def start(self) -> None:
        self.p.start()
        self.d.start()

    def close(self) -> None:
        self.d.stop()
        self.p.stop()

    def body_targets(self) -> list[Target]:
        return [
            Target(f"{n.role}-sim", f"127.0.0.1:{n.port}", path)
            for n in (self.p, self.d)
            for path in ("/v1/completions", "/v1/chat/completions")
        ]

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 600)))

    def prefill(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.p.model, "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": STUB}  # fmt: skip
        resp = httpx.post(self.p.url + "/v1/completions", json=body, timeout=30.0)
        resp.raise_for_status()
        return resp.json()["kv_transfer_params"]

    def decode(self, prompt: str, params: dict[str, Any]) -> int | None:
        """The decode's HTTP status (None when it did not answer within REQUEST_BOUND_S or the
        connection broke: ``-1``)."""
        body = {"model": self.d.model, "prompt": prompt, "max_tokens": 4,
                "kv_transfer_params": params}  # fmt: skip
        try:
            return httpx.post(self.d.url + "/v1/completions", json=body,
                              timeout=REQUEST_BOUND_S).status_code  # fmt: skip
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return -1

    # -------------------------------------------------------------- at rest

    def check(self, ctx: Ctx, kind: str) -> None:
        for node in (self.p, self.d):
            problem = node.problem()
            if problem:
                ctx.tally.violate(kind, "crashes", problem)
                node.restart()
        vf = int(self.d.stats().get("verified_failed", 0))
        if vf > self._verified_failed:
            ctx.tally.violate(kind, "stale_or_corrupt", "decode sim verified wrong bytes",
                              vf - self._verified_failed)  # fmt: skip
        self._verified_failed = vf
        end = time.monotonic() + HOLDS_DRAIN_S
        held = self.p.stats().get("holds_outstanding", 0)
        while held and time.monotonic() < end:
            time.sleep(0.2)
            held = self.p.stats().get("holds_outstanding", 0)
        if held:
            ctx.tally.violate(kind, "leaked_holds", f"prefill sim still holds {held} requests",
                              int(held))  # fmt: skip

    def restarted_decode(self) -> None:
        """The decode sim restarted: its verified_failed counter starts again."""
        self._verified_failed = 0


def _in_background(fn, *args):  # noqa: ANN001, ANN202
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn(*args)), daemon=True)
    t.start()
    return t, box


def _judge_request(ctx: Ctx, kind: str, t: threading.Thread, box: dict, since: float) -> None:
    t.join(timeout=max(0.0, since + REQUEST_BOUND_S + 5.0 - time.monotonic()))
    status = box.get("v")
    if t.is_alive() or ("v" in box and status is None):
        ctx.tally.violate(kind, "hangs", f"decode request unanswered after {REQUEST_BOUND_S:g}s")
    ctx.tally.note(kind, f"decode:{status}")


def sim_kill9(ctx: Ctx, kind: str) -> None:
    """kill -9 a sim (and its sidecars) while a decode request pulls; restart it, same port."""
    _sim_fault(ctx, kind, stop=False)


def sim_sigstop(ctx: Ctx, kind: str) -> None:
    """SIGSTOP a sim and its sidecars while a decode request pulls; SIGCONT after a pause."""
    _sim_fault(ctx, kind, stop=True)


def _sim_fault(ctx: Ctx, kind: str, stop: bool) -> None:
    sims: Sims = ctx.sims  # type: ignore[assignment]
    node = ctx.rng.choice([sims.p, sims.d])
    prompt = sims.prompt()
    params = sims.prefill(prompt)
    since = time.monotonic()
    t, box = _in_background(sims.decode, prompt, params)
    time.sleep(ctx.rng.uniform(0.0, 0.3))  # a random point of the request
    ctx.tally.note(kind, node.role)
    if stop:
        pids = node.pids()
        osproc.stop(pids)
        try:
            time.sleep(ctx.rng.uniform(0.1, 2.5))
        finally:
            osproc.cont(pids)
        _judge_request(ctx, kind, t, box, time.monotonic())
        return
    node.kill()
    _judge_request(ctx, kind, t, box, since)
    node.restart()
    if node is sims.d:
        sims.restarted_decode()


def sim_forged_ticket(ctx: Ctx, kind: str) -> None:
    """Post a completion to the decode's OpenAI port whose transfer params carry a ticket that
    names the campaign's listener (MAC invalid). No contact, no secret, no 200."""
    sims: Sims = ctx.sims  # type: ignore[assignment]
    prompt = sims.prompt()
    params = sims.prefill(prompt)
    forged = []
    for t in params["kvxferd_tickets"]:
        t = dict(t, peer=ctx.listener.address, token="0" * 64, hold_id="f" * 32)
        forged.append(t)
    status = sims.decode(prompt, {**params, "kvxferd_tickets": forged})
    ctx.tally.note(kind, f"decode:{status}")
    if status == 200:
        ctx.tally.violate(kind, "stale_or_corrupt", "decode answered 200 to a forged ticket")
    elif status is None:
        ctx.tally.violate(kind, "hangs", "decode did not answer a forged ticket in time")
    for contact in ctx.listener.take():
        ctx.tally.note(kind, "forged_peer_contacted")
        if contact.secret_seen:
            ctx.tally.violate(
                kind,
                "secret_leaks",
                "the decode sim's sidecar sent the peer secret to the listener",
            )
