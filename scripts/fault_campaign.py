"""Fault campaign (issue 10): randomized faults against real sidecars and sims on loopback, and
the invariants that must hold after each one.

    python scripts/fault_campaign.py --faults 100 --seed 1 --json out.json
    python scripts/fault_campaign.py --faults 16 --seed 1 --json out.json --quick
    python scripts/fault_campaign.py --soak-seconds 1800 --concurrency 8 --json soak.json

Targets: a prefill/decode pair of ``kvxferd serve`` over pools this process owns (it plays both
engines, so it sees every byte), and, unless ``--quick``, a prefill and a decode ``kvxferd sim``.
NIXL over UCX on ``lo``; every address is loopback. As root, the campaign re-runs itself in a
private mount namespace with its own tmpfs on /dev/shm (exact leftover counts, and /dev/shm can
be filled); otherwise the shm_full kind is skipped with its reason.

Prints one line per fault and a summary; writes the JSON (keys: faults, hangs, stale_or_corrupt,
writes_after_failed, leaked_holds, leaked_handles, crashes, leftover_shm, secret_leaks, by_kind);
exits 1 when any invariant was violated (soak: when any request failed or a byte was wrong), 2
when the targets did not start.
Everything is bounded: N faults, each with its own deadlines; it stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("KVXFERD_PROGRESS_THREAD", "false")  # no idle core spinning per agent
# Caps that fit CHILD_NOFILE (1024) open files by kvxferd.api.fdbudget (the sidecar refuses to
# start otherwise), and timeouts inside bodies.ANSWER_BOUND_S.
for _name, _value in (("PEER_MAX_CONNECTIONS", "320"), ("ENGINE_MAX_CONNECTIONS", "64"),
                      ("HEADER_TIMEOUT_S", "5"), ("BODY_TIMEOUT_S", "5")):  # fmt: skip
    os.environ.setdefault(f"KVXFERD_{_name}", _value)

from benchlib.faults import bodies, kinds, osproc, shm, shmfull, sims  # noqa: E402
from benchlib.faults.context import Ctx  # noqa: E402
from benchlib.faults.listener import ForgedPeer  # noqa: E402
from benchlib.faults.pair import Pair, write_toy_config  # noqa: E402
from benchlib.faults.rest import Rest  # noqa: E402
from benchlib.faults.tally import INVARIANTS, Tally  # noqa: E402

from kvxferd.errors import StartupError  # noqa: E402

PAIR_KINDS = ("kill9", "sigstop", "deadline", "lease", "ticket", "body", "flood", "shm_full")
SIM_KINDS = ("sim_kill9", "sim_sigstop", "sim_forged_ticket")
WARMUP_PULLS = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=50, metavar="N", help="faults to run")
    p.add_argument("--seed", type=int, default=1, metavar="S", help="random seed")
    p.add_argument("--json", metavar="PATH", help="write the JSON report here")
    p.add_argument(
        "--quick", action="store_true", help="the sidecar pair only (no sims): the CI smoke run"
    )
    p.add_argument(
        "--kinds", metavar="K,K", help=f"only these kinds ({', '.join(PAIR_KINDS + SIM_KINDS)})"
    )
    p.add_argument(
        "--soak-seconds",
        type=float,
        metavar="S",
        help="soak instead: verified requests through proxy, prefill and decode sims",
    )
    p.add_argument("--concurrency", type=int, default=8, metavar="C", help="soak concurrency")
    p.add_argument(
        "--no-namespace",
        action="store_true",
        help="do not re-run in a private mount namespace (shm_full is skipped)",
    )
    args = p.parse_args(argv)
    if args.faults < 0 or args.concurrency < 1:
        p.error("--faults must be >= 0 and --concurrency >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not args.no_namespace:
        shm.reexec_private([str(Path(__file__).resolve()), *argv])
    private_why = shm.enter_private()
    if args.no_namespace:
        private_why = "--no-namespace: /dev/shm is the host's (shm_full skipped)"
    osproc.limit_children_nofile()
    secret = secrets.token_hex(16)
    os.environ["KVXFERD_PEER_TOKEN"] = secret
    os.environ["PYTHONUNBUFFERED"] = "1"
    env = dict(os.environ)
    tmp = tempfile.mkdtemp(prefix="kvxferd-campaign-")
    try:
        config = write_toy_config(tmp)
        if args.soak_seconds is not None:
            from benchlib.faults.soak import soak

            result = soak(config, args.soak_seconds, args.concurrency, args.seed)
            _write(args.json, result)
            print(json.dumps(result, indent=1))
            return 0 if result["ok"] else 1
        try:
            tally = run_campaign(args, tmp, config, env, secret, private_why)
        except StartupError as exc:
            print(f"fault_campaign: the targets did not start: {exc}", file=sys.stderr)
            return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = tally.report()
    _write(args.json, report)
    _summary(report)
    return 1 if tally.violations() else 0


def _kinds(args: argparse.Namespace, private_why: str, tally: Tally) -> list[str]:
    chosen = list(PAIR_KINDS) + ([] if args.quick else list(SIM_KINDS))
    if args.kinds:
        wanted = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = set(wanted) - set(PAIR_KINDS + SIM_KINDS)
        if unknown:
            raise SystemExit(f"--kinds: unknown {sorted(unknown)}")
        chosen = wanted
    if "shm_full" in chosen and private_why:
        tally.skip("shm_full", private_why)
        chosen.remove("shm_full")
    return chosen


def run_campaign(args: argparse.Namespace, tmp: str, config: str, env: dict[str, str],
                 secret: str, private_why: str) -> Tally:  # fmt: skip
    """Start the targets, run the faults with their checks, tear down, count leftovers."""
    rng = random.Random(args.seed)
    tally = Tally()
    kinds_run = _kinds(args, private_why, tally)
    shm_before = shm.entries()
    pair = Pair(tmp, config, env, secret, rng)
    listener = ForgedPeer(secret).start()
    target_sims = None
    try:
        pair.start()
        ctx = Ctx(rng, tally, pair, Rest(pair, tally), listener, secret, quick=args.quick)
        if any(k.startswith("sim_") for k in kinds_run) or not args.quick:
            target_sims = sims.Sims(config, env, rng)
            target_sims.start()
            ctx.sims = target_sims
        for _ in range(WARMUP_PULLS):
            kinds.healthy_pull(ctx, "warmup")
        ctx.rest.check("warmup")
        order: list[str] = []
        for i in range(args.faults):
            if not order:
                order = list(kinds_run)
                rng.shuffle(order)
            kind = order.pop()
            _one(ctx, kind, i, args.faults, config, env)
        ctx.rest.holds("end", final=True)
    finally:
        listener.close()
        _teardown(pair, target_sims, tally)
    _leftovers(tally, shm_before, pair)
    return tally


def _one(ctx: Ctx, kind: str, i: int, total: int, config: str, env: dict[str, str]) -> None:
    t0 = time.monotonic()
    before = ctx.tally.violations()
    try:
        if kind == "shm_full":
            shmfull.shm_full(ctx, kind, config, env)
        elif kind in SIM_KINDS:
            getattr(sims, kind)(ctx, kind)
        elif kind in ("body", "flood"):
            getattr(bodies, kind)(ctx, kind)
        else:
            getattr(kinds, kind)(ctx, kind)
    except Exception as exc:  # noqa: BLE001 - the campaign goes on; the note says what broke
        ctx.tally.note(kind, f"campaign_error:{type(exc).__name__}")
        print(f"  {kind}: campaign error: {exc!r}\n{traceback.format_exc(limit=3)}",
              file=sys.stderr)  # fmt: skip
    ctx.tally.fault(kind)
    try:
        ctx.rest.check(kind)
        if ctx.sims is not None and (kind in SIM_KINDS or kind == "body"):
            ctx.sims.check(ctx, kind)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        ctx.tally.note(kind, f"campaign_error:{type(exc).__name__}")
        print(f"  {kind}: check error: {exc!r}", file=sys.stderr)
    found = ctx.tally.violations() - before
    print(f"fault {i + 1}/{total} {kind:<18} {time.monotonic() - t0:6.1f}s  "
          f"{'violations: ' + str(found) if found else 'ok'}", flush=True)  # fmt: skip


def _teardown(pair: Pair, target_sims: sims.Sims | None, tally: Tally) -> None:
    """Stop everything with SIGTERM; a process that needs SIGKILL to go is a shutdown hang."""
    if target_sims is not None:
        for node in (target_sims.d, target_sims.p):
            if node.child is not None:
                osproc.cont(node.pids())
                code = node.child.stop(20.0)
                tally.note("teardown", f"{node.role}-sim:exit{code}")
    for node in (pair.d, pair.p):
        code = node.stop() if node.alive() else 0
        tally.note("teardown", f"{node.name}:exit{code}")
        if code == -9:
            tally.violate("teardown", "hangs", f"{node.name} ignored SIGTERM for 20s")
    for node in (pair.d, pair.p):
        node.pool.close()


def _leftovers(tally: Tally, before: set[str], pair: Pair) -> None:
    """/dev/shm after teardown: everything when it is our private tmpfs, else our pools'."""
    shm.unfill()
    if shm.is_private():
        left = shm.entries()
    else:
        left = (shm.entries() - before) & pair.pool_names
        tally.note("teardown", "shm_scope:campaign_pools_only")
    if left:
        tally.violate("teardown", "leftover_shm", f"{sorted(left)[:5]}", len(left))


def _write(path: str | None, obj: object) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def _summary(report: dict) -> None:
    print(f"\n{report['faults']} faults; " + ", ".join(f"{k}={report[k]}" for k in INVARIANTS))
    for kind, e in report["by_kind"].items():
        bad = {k: e[k] for k in INVARIANTS if e[k]}
        print(f"  {kind:<18} {e['count']:>4} faults  {bad or ''} {e['skipped']}")
        for ex in e["examples"][:3]:
            print(f"      e.g. {ex}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
