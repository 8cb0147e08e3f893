"""Tables and the latency-vs-concurrency plot of the control-plane benchmark."""

from __future__ import annotations


def _f(x: float | None, fmt: str = "8.2f") -> str:
    return "-".rjust(len(format(0.0, fmt))) if x is None else format(x, fmt)


def levels_table(result: dict) -> str:
    """One row per concurrency: throughput, latency of each mode, overheads."""
    head = (
        f"{'conc':>4} {'rps':>7} {'p50':>8} {'p99':>8} {'direct':>8} {'d-p99':>8} "
        f"{'local':>8} {'l-p99':>8} {'l-rps':>7} {'proxy+':>8} {'P/D+':>8} {'load':>5} "
        f"{'steal':>5} {'err':>4}"
    )
    out = [head]
    for lv in result["levels"]:
        out.append(
            f"{lv['concurrency']:>4} {_f(lv['rps'], '7.1f')} {_f(lv['p50_ms'])} "
            f"{_f(lv['p99_ms'])} {_f(lv['direct_p50_ms'])} {_f(lv['direct_p99_ms'])} "
            f"{_f(lv['local_p50_ms'])} {_f(lv['local_p99_ms'])} {_f(lv['local_rps'], '7.1f')} "
            f"{_f(lv['proxy_overhead_p50_ms'])} {_f(lv['pd_overhead_p50_ms'])} "
            f"{_f(lv['load_average'], '5.1f')} {_f(lv['cpu_cores'].get('steal'), '5.2f')} "
            f"{lv['errors'] + lv['direct_errors'] + lv['local_errors']:>4}"
        )
    out.append(
        "ms. rps/p50/p99: through the proxy; direct: the proxy's two calls made by the client; "
        "local: decode sim without kv_transfer_params (no transfer); proxy+ = p50 - direct p50; "
        "P/D+ = p50 - local p50; load: 1-min load average after the level; steal: CPU the "
        "hypervisor took (cores, average); err: requests answered with an error (any mode, "
        "warm-up included; not timed)."
    )
    return "\n".join(out)


def profile_table(result: dict) -> str:
    """The concurrency-1 breakdown, one line per piece."""
    p = result["profile"]
    rows: list[tuple[str, float | None]] = [(k, v) for k, v in p["p50_ms"].items()]
    rows += [(k, v) for k, v in p["derived_ms"].items()]
    for k, v in (p["pull_sidecar_mean_ms"] or {}).items():
        rows.append((f"pull: sidecar {k} (mean)", v))
    width = max(len(k) for k, _ in rows)
    out = [f"where one request's time goes at concurrency 1 ({p['requests']} requests, ms):"]
    out += [f"  {k:<{width}} {_f(v)}" for k, v in rows]
    if p["pull_sidecar_mean_ms"] is None:
        out.append("  (decode sidecar /metrics not reachable: no per-phase pull times)")
    by_mode = p.get("cpu_ms_by_mode")
    if by_mode:
        roles = list(by_mode["proxy"])
        width = max(len(r) for r in roles)
        out.append("\nCPU ms per request at concurrency 1, by process (sequential, /proc):")
        out.append(f"  {'':<{width}} {'proxy':>7} {'local':>7} {'added':>7}")
        out += [f"  {r:<{width}} {by_mode['proxy'][r]:7.3f} {by_mode['local'][r]:7.3f} "
                f"{by_mode['added'][r]:7.3f}" for r in roles]  # fmt: skip
    return "\n".join(out)


MODES = (("", "P/D via proxy", "-"), ("direct_", "P/D direct", "--"), ("local_", "local", ":"))


def plot(result: dict, path: str) -> None:
    """p50/p99 latency and requests/s vs concurrency for the three modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(result["levels"], key=lambda lv: lv["concurrency"])
    xs = [lv["concurrency"] for lv in levels]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (prefix, label, style) in enumerate(MODES):
        color = f"C{i}"
        lat.plot(xs, [lv[f"{prefix}p50_ms"] for lv in levels], style, color=color, marker="o",
                 label=f"{label} p50")  # fmt: skip
        lat.plot(xs, [lv[f"{prefix}p99_ms"] for lv in levels], style, color=color, marker="x",
                 alpha=0.5, label=f"{label} p99")  # fmt: skip
        thr.plot(xs, [lv[f"{prefix}rps"] for lv in levels], style, color=color, marker="o",
                 label=label)  # fmt: skip
    c1 = next((lv for lv in levels if lv["concurrency"] == 1), None)
    if c1 is not None:
        goal = c1["local_p50_ms"] + result.get("target", {}).get("target_ms", 3.0)
        lat.plot([1], [goal], "*", color="k", markersize=10, label="target: local p50 + 3 ms")
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.grid(True, alpha=0.3)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms)")
    lat.set_title("end-to-end latency of a tiny request")
    thr.set_ylabel("requests / s")
    thr.set_title("throughput")
    lat.legend(fontsize=7)
    thr.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"kvxferd control plane ({m['cpu_count']} CPUs, loopback, "
                 f"{result['settings']['kv_bytes_per_request']} B of KV per request)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
