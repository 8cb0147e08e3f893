"""Where one tiny P/D request spends its time at concurrency 1.

Each iteration sends, one after another: an empty HTTP call to the decode sim, to the prefill
sidecar's peer API and to the decode sidecar's engine socket (the per-hop floors), the prompt
computed locally on the prefill sim and on the decode sim, the two direct calls (prefill with
the transfer stub, decode with the params) and the same request through the proxy.
Client-side pieces are medians; the decode sidecar's pull phases
(``kvxferd_pull_phase_duration_seconds``) are means over the iterations' pulls (histograms
keep only sums and counts).
"""

from __future__ import annotations

import statistics
import time

import httpx

from . import control_load as load
from . import control_probe as probe

NOTES = {
    "http_floor": "GET /health on the decode sim: one client -> uvicorn/FastAPI round trip.",
    "peer_http_floor": "GET /healthz on the prefill sidecar's peer API (what a claim rides on).",
    "engine_api_floor": "GET /healthz on the decode sidecar's engine socket (Unix; what hold, "
    "pull and pull status ride on).",
    "prefill_local": "the prompt on the prefill sim without kv_transfer_params: HTTP + pattern "
    "write + digest, no hold.",
    "decode_local": "the prompt on the decode sim without kv_transfer_params (the colocated "
    "baseline).",
    "direct_prefill": "prefill sim with the transfer stub: HTTP + compute + hold on its "
    "sidecar (engine socket) + ticket.",
    "direct_decode": "decode sim with the params: HTTP + pull (one run_pull call: handshake "
    "cache, the claim HTTP to the prefill sidecar concurrent with plan and NIXL READ, notify) + "
    "verify + digest.",
    "proxy_total": "the same request through the proxy.",
    "hold": "direct_prefill - prefill_local.",
    "pull_vs_compute": "direct_decode - decode_local (pull + verify instead of computing).",
    "proxy_forwarding": "proxy_total - direct_prefill - direct_decode (the proxy's two "
    "forwards, JSON handling, the client's extra hop).",
    "pd_overhead": "proxy_total - decode_local = proxy_forwarding + direct_prefill + "
    "pull_vs_compute.",
    "pull_sidecar": "decode sidecar phases (mean ms per pull); the claim runs concurrently "
    "with plan, post and wire, so other = total - handshake - max(claim, post + wire + notify "
    "wait) (planning, task switches); wire = post .. READ seen done; notify = a done READ "
    "waiting for its claim's answer.",
    "decode_rest": "pull_vs_compute - sidecar total: the decode engine's pull and status calls "
    "on the engine socket, verify instead of write, thread hops.",
}


async def _get(client: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    resp = await client.get(url)
    ms = (time.perf_counter() - t0) * 1e3
    if resp.status_code != 200:
        raise load.LoadError(f"GET {url}: HTTP {resp.status_code}")
    return ms


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    resp = await client.post(url + load.PATH, json=body)
    ms = (time.perf_counter() - t0) * 1e3
    load.answer(resp, url)
    return ms


async def profile(
    ep: load.Endpoints,
    wl: load.Workload,
    n: int,
    decode: probe.SidecarAddress | None,
    prefill: probe.SidecarAddress | None,
) -> dict:
    """``n`` sequential iterations (after one untimed one); the profile dict of the JSON."""
    keys = ("http_floor", "peer_http_floor", "engine_api_floor", "prefill_local", "decode_local",
            "direct_prefill", "direct_decode", "proxy_total")  # fmt: skip
    samples: dict[str, list[float]] = {k: [] for k in keys}
    decode_peer = decode.peer if decode else None
    phases_before = None
    stats_before = None
    uds = decode.engine_socket if decode else None
    engine = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds)) if uds else None
    async with load.new_client() as client:
        for it in range(n + 1):
            row = {
                "http_floor": await _get(client, ep.decode + "/health"),
                "peer_http_floor": (
                    await _get(client, f"http://{prefill.peer}/healthz") if prefill else None
                ),
                "engine_api_floor": (
                    await _get(engine, "http://sidecar/healthz") if engine else None
                ),
                "prefill_local": await _post(client, ep.prefill, wl.body(it)),
                "decode_local": await _post(client, ep.decode, wl.body(it)),
            }
            if it == 0:  # untimed: warm every connection and the handshake cache
                await load.one(client, "direct", ep, wl, it)
                await load.one(client, "proxy", ep, wl, it)
                phases_before = probe.phase_sums(decode_peer) if decode_peer else None
                stats_before = probe.stats(ep.decode)
                continue
            _, halves, _ = await load.one(client, "direct", ep, wl, it)
            assert halves is not None
            row["direct_prefill"], row["direct_decode"] = halves
            row["proxy_total"], _, _ = await load.one(client, "proxy", ep, wl, it)
            for k, v in row.items():
                if v is not None:
                    samples[k].append(v)
    if engine is not None:
        await engine.aclose()
    stats_after = probe.stats(ep.decode)
    p50 = {k: statistics.median(v) if v else None for k, v in samples.items()}
    derived = {
        "hold": p50["direct_prefill"] - p50["prefill_local"],
        "pull_vs_compute": p50["direct_decode"] - p50["decode_local"],
        "proxy_forwarding": p50["proxy_total"] - p50["direct_prefill"] - p50["direct_decode"],
        "pd_overhead": p50["proxy_total"] - p50["decode_local"],
    }
    assert stats_before is not None
    d = probe.delta(stats_before, stats_after, ("pulls_ok", "pulls_failed"))
    phases = None
    if decode_peer and phases_before is not None:
        after = probe.phase_sums(decode_peer)
        if after is not None:
            phases = probe.phase_means_ms(phases_before, after)
            parts = ("handshake", "claim", "post", "wire")
            if "total" in phases and all(p in phases for p in parts):
                read = phases["post"] + phases["wire"] + phases.get("notify", 0.0)
                phases["other"] = phases["total"] - phases["handshake"] - max(phases["claim"], read)
    if phases and "total" in phases:
        derived["decode_rest"] = derived["pull_vs_compute"] - phases["total"]
    return {
        "requests": n,
        "p50_ms": p50,
        "derived_ms": derived,
        "pull_sidecar_mean_ms": phases,
        "pulls": d["pulls_ok"],
        "pulls_failed": d["pulls_failed"],
        "decode_sidecar_peer": decode_peer,
        "decode_engine_socket": uds,
        "prefill_sidecar_peer": prefill.peer if prefill else None,
        "notes": NOTES,
    }


async def cpu_by_mode(ep: load.Endpoints, wl: load.Workload, n: int, meter: probe.CpuMeter) -> dict:
    """CPU ms per request of each process, ``n`` sequential requests through the proxy and
    ``n`` computed locally (after one untimed each), and what the P/D path adds per process.

    At concurrency 1 one request's latency is mostly the CPU of the processes it passes
    through one after another, so this says where a P/D millisecond can come from.
    /proc counts in clock ticks (10 ms): a process's figure is good to about 10 ms / ``n``.
    """
    out: dict[str, dict[str, float]] = {}
    async with load.new_client() as client:
        for mode in ("proxy", "local"):
            await load.one(client, mode, ep, wl, 0)
            meter.restart()
            for i in range(n):
                await load.one(client, mode, ep, wl, i)
            cpu_s = meter.read()["cpu_s"]
            out[mode] = {role: round(s * 1e3 / n, 3) for role, s in cpu_s.items()}
    out["added"] = {r: round(out["proxy"][r] - out["local"][r], 3) for r in out["proxy"]}
    for row in out.values():
        row["all"] = round(sum(v for k, v in row.items() if k != "all"), 3)
    return out
