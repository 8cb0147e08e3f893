"""Run one simulated engine: plan and create the pools, start (or attach to) and register one
sidecar per rank, serve HTTP, print the ready line, and on SIGINT/SIGTERM undo all of it (sidecars
it attached to keep running) and exit 0.

Ready line (stdout, once): ``kvxferd sim ready url=http://HOST:PORT role=ROLE tp=N model=NAME``.
The HTTP listener has the proxy's front-door limits (connections, head and body sizes, read
timeouts; ``SimOptions.limits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, replace
from types import FrameType

import uvicorn

from kvxferd.aio import run as run_main
from kvxferd.api.limits import EdgeLimits
from kvxferd.api.sockets import bind_tcp
from kvxferd.config import Config
from kvxferd.errors import ConfigError
from kvxferd.layout import PlanOptions, load_hf_config
from kvxferd.proxy.server import FRONT_DOOR_LIMITS, front_door_config
from kvxferd.sim.app import sim_app
from kvxferd.sim.engine import EngineSettings, PullFailurePolicy, Role, SimEngine
from kvxferd.sim.kvpool import RankPool, default_pool_blocks, plan_ranks
from kvxferd.sim.sidecars import (
    RankSidecar,
    SidecarProcess,
    attach_sidecars,
    register_pools,
    start_sidecars,
)

log = logging.getLogger(__name__)

READY_PREFIX = "kvxferd sim ready"
_DIR_PREFIX = "kvxferd-sim-"
MAX_LEASE_S = 600.0
MAX_PULL_DEADLINE_S = Config().max_pull_deadline_s
"""The sidecars' default bound on a pull's deadline (``kvxferd serve --max-pull-deadline``)."""
SIM_STORE_DRAM_BYTES = 256 << 20
"""DRAM pool of each sidecar's store when the sim starts them with --store."""


@dataclass(frozen=True)
class SimOptions:
    """Everything ``kvxferd sim`` takes."""

    role: Role
    config: str
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    pool_blocks: int | None = None
    served_model_name: str | None = None
    on_pull_failure: PullFailurePolicy = "recompute"
    lease_s: float | None = None
    pull_timeout_s: float = 30.0
    unanswered_retry_s: float = 1.0
    """Prefill: interval of the aborts retried for holds no sidecar answered (EngineSettings)."""
    unanswered_bound_s: float = 600.0
    """Prefill: how long such a hold's blocks wait for an answer before they are freed."""
    kv_cache_dtype: str = "auto"
    attn_pack_size: int = 1
    log_level: str = "info"
    sidecar_timeout_s: float = 60.0
    """Bound on starting (or reaching) the sidecars and on each call to them."""
    sidecar_sockets: tuple[str, ...] = ()
    """Engine sockets of running sidecars to attach to, one per rank in rank order; empty: start
    our own."""
    store_dir: str = ""
    """Prefill: the sidecars' store directory (a prefix-cache tier across restarts); "" = none."""
    store_chunk_tokens: int = 64
    """Tokens per store chunk (--store-chunk-tokens of the sidecars)."""
    limits: EdgeLimits = FRONT_DOOR_LIMITS
    """Connection cap, head and body sizes and read timeouts of the HTTP listener."""
    event_loop: str = "auto"
    """Event loop of the sim and of the sidecars it starts (kvxferd.aio)."""


class _Server(uvicorn.Server):
    """uvicorn.Server that leaves SIGINT/SIGTERM to us (we stop sidecars after it)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def _stop_requested(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # during startup: unwind through the finally blocks below


def run_sim(opts: SimOptions) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status (0 after a clean stop)."""
    if opts.tp < 1:
        raise ConfigError(f"--tp: must be >= 1, got {opts.tp}")
    if opts.lease_s is not None and opts.lease_s <= 0:
        raise ConfigError(f"--lease: must be > 0, got {opts.lease_s}")
    _check_sidecar_sockets(opts)
    hf = load_hf_config(opts.config)
    engine_id = f"sim{secrets.token_hex(4)}"
    plan = PlanOptions(tp_size=opts.tp, engine_id=engine_id, kv_cache_dtype=opts.kv_cache_dtype,
                       attn_pack_size=opts.attn_pack_size)  # fmt: skip
    blocks = opts.pool_blocks or default_pool_blocks(hf, plan)
    if blocks < 2:
        raise ConfigError(f"--pool-blocks: must be >= 2, got {blocks}")
    manifests = plan_ranks(hf, replace(plan, num_blocks=blocks))
    model = opts.served_model_name or manifests[0].model or opts.config
    signal.signal(signal.SIGTERM, _stop_requested)
    pools: list[RankPool] = []
    sidecars: list[RankSidecar] = []
    _sweep_stale_dirs()
    tmp = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    # The peer secret: prefill mints its tickets with it (kvxferd.sim.minting) once it has seen
    # the sidecars sign with the same; unknown for attached sidecars unless set in the env.
    token = os.environ.get("KVXFERD_PEER_TOKEN") or ""
    try:
        for m in manifests:
            pools.append(RankPool(m))
        if opts.sidecar_sockets:
            sidecars = list(attach_sidecars(opts.sidecar_sockets, opts.sidecar_timeout_s))
            register_pools(sidecars, pools, opts.sidecar_timeout_s)
        elif opts.role != "colocated":
            token = token or secrets.token_hex(32)
            sidecars = list(_start_sidecars(opts, tmp, engine_id, pools, token))
        for p in pools:
            p.unlink()
        log.info("%s: %d ranks, %d blocks per rank", engine_id, opts.tp, blocks)
        run_main(_serve(opts, engine_id, model, pools, sidecars, token), opts.event_loop)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        owned = [s for s in sidecars if isinstance(s, SidecarProcess)]
        for s in owned:
            s.child.terminate()
        for s in owned:
            if s.stop() != 0:
                log.warning("sidecar %s exited with %s", s.engine_id, s.child.proc.returncode)
        for p in pools:
            p.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _sweep_stale_dirs() -> None:
    """Remove socket dirs left by sims that were killed (their pid, in the name, is gone)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name.removeprefix(_DIR_PREFIX).split("-", 1)[0]
        if not name.startswith(_DIR_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            continue


def _check_sidecar_sockets(opts: SimOptions) -> None:
    """--sidecar-socket: one per rank, and only for roles that move KV."""
    given = len(opts.sidecar_sockets)
    if not given:
        return
    if opts.role == "colocated":
        raise ConfigError("--sidecar-socket: a colocated sim moves no KV and uses no sidecar")
    if given != opts.tp:
        raise ConfigError(
            f"--sidecar-socket: {given} given for --tp {opts.tp} (one per rank, in rank order)"
        )
    if len(set(opts.sidecar_sockets)) != given:
        raise ConfigError("--sidecar-socket: each rank needs its own sidecar")


def sidecar_args(opts: SimOptions) -> list[str]:
    """The ``kvxferd serve`` flags every rank's sidecar gets from the sim's options (its leases
    and pull deadline allowed as long as the sim asks for)."""
    extra = ["--peer-host", opts.host, "--log-level", _child_level(opts.log_level)]
    extra += ["--event-loop", opts.event_loop]
    if opts.lease_s is not None:
        extra += ["--lease", str(opts.lease_s), "--max-lease", str(max(opts.lease_s, MAX_LEASE_S))]
    if opts.pull_timeout_s > MAX_PULL_DEADLINE_S:  # else the sidecar refuses its pulls (422)
        extra += ["--max-pull-deadline", str(opts.pull_timeout_s)]
    if opts.store_dir:
        extra += ["--store-dir", opts.store_dir, "--store-chunk-tokens"]
        extra += [str(opts.store_chunk_tokens), "--store-dram-bytes", str(SIM_STORE_DRAM_BYTES)]
    return extra


def _start_sidecars(
    opts: SimOptions, tmp: str, engine_id: str, pools: list[RankPool], token: str
) -> list[SidecarProcess]:
    """One ``kvxferd serve`` per rank (killed with us), each registering its rank's pool;
    ``token`` is their peer secret."""
    extra = sidecar_args(opts)
    names = [f"{engine_id}-tp{r}" for r in range(opts.tp)]
    sidecars = start_sidecars(tmp, names, *extra, token=token,
                              per_rank_args=[["--engine-id", n] for n in names],
                              die_with_parent=True, timeout_s=opts.sidecar_timeout_s)  # fmt: skip
    try:
        register_pools(sidecars, pools, opts.sidecar_timeout_s)
    except BaseException:
        for s in sidecars:
            s.kill()
        raise
    return sidecars


def _child_level(level: str) -> str:
    """Sidecars log one notch quieter than the sim unless asked for debug."""
    return "debug" if level.lower() == "debug" else "warning"


def engine_settings(opts: SimOptions, engine_id: str) -> EngineSettings:
    """How the engine of ``opts`` behaves."""
    settings = EngineSettings(role=opts.role, engine_id=engine_id,
                              on_pull_failure=opts.on_pull_failure, lease_s=opts.lease_s,
                              pull_timeout_s=opts.pull_timeout_s,
                              unanswered_retry_s=opts.unanswered_retry_s,
                              unanswered_bound_s=opts.unanswered_bound_s)  # fmt: skip
    if opts.store_dir and opts.role == "prefill":
        settings = replace(settings, store_chunk_tokens=opts.store_chunk_tokens)
    return settings


async def _serve(
    opts: SimOptions, engine_id: str, model: str, pools: list[RankPool],
    sidecars: list[RankSidecar], token: str,
) -> None:  # fmt: skip
    sock = bind_tcp(opts.host, opts.port, "--port")
    settings = engine_settings(opts, engine_id)

    def alive() -> str:
        return "; ".join(p for p in (s.problem() for s in sidecars) if p)

    engine = SimEngine(
        settings,
        pools,
        clients=[s.async_client(timeout_s=opts.sidecar_timeout_s) for s in sidecars],
        peer=sidecars[0].peer if sidecars else "",
        alive=alive,
        secret=token.encode() or None,
    )
    server = _Server(front_door_config(sim_app(engine, model), opts.limits, "sim",
                                       log_level=opts.log_level.lower(), lifespan="off",
                                       timeout_graceful_shutdown=5))  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            host, port = sock.getsockname()[:2]
            url_host = f"[{host}]" if ":" in host else host
            print(f"{READY_PREFIX} url=http://{url_host}:{port} role={opts.role} tp={opts.tp} "
                  f"model={model}", flush=True)  # fmt: skip
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        await engine.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already stopping: finish the cleanup
        sock.close()
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
