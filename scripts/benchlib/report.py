"""Machine description, the results table and the throughput plot of the transfer benchmark."""

from __future__ import annotations

import contextlib
import os
import platform
from importlib import metadata

from . import ucx

METHODS = (
    ("kvxferd_gbps", "kvxferd pull", "-"),
    ("ceiling_gbps", "ceiling (1 desc/region)", "--"),
    ("per_layer_gbps", "per-layer scheme", "-."),
    ("ucx_gbps", "ucx_perftest ucp_get", ":"),
    ("memcpy_gbps", "memcpy", ":"),
)


def machine() -> dict:
    """CPU count and model, memory, load, Python, NIXL and libucx versions."""
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nixl": version("nixl"),
        "numpy": version("numpy"),
        "libucx": ucx.version(),
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
        "load_average_start": list(os.getloadavg()),
    }


def fmt(x: float | None, spec: str = "6.2f") -> str:
    """``x`` formatted, or ``-`` (as wide) for a measurement that does not apply."""
    if x is not None:
        return format(x, spec)
    width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
    return format("-", f">{width}") if width else "-"


_f = fmt


def _label(case: dict) -> str:
    """The layout, with the UCX transport set when it is not UCX's default."""
    tls = case.get("tls", "default")
    return case["layout"] if tls == "default" else f"{case['layout']}/{tls}"


def tcp_bounds(result: dict) -> str:
    """Where the over-TCP targets (>= 5x per-layer, >= 0.5x memcpy) stand against the kernel's
    own TCP: a target above the kernel's loopback TCP cannot be met by any transport here."""
    out = []
    for c in result["cases"]:
        tcp = c.get("tcp_kernel_gbps")
        if not tcp:
            continue
        kx, pl, mc = c["kvxferd_gbps"], c["per_layer_gbps"], c["memcpy_gbps"]
        need = [("0.5x memcpy", 0.5 * mc)] + ([("5x per-layer", 5 * pl)] if pl else [])
        said = ", ".join(
            f"{name} = {gbps:.2f} ({'above' if gbps > tcp else 'within'} it)" for name, gbps in need
        )
        out.append(
            f"{_label(c)} {c['tokens']} {c['pattern']}: kernel TCP {tcp:.2f} GB/s "
            f"({c['tcp_kernel_streams']} streams); kvxferd {kx:.2f} = {kx / tcp:.2f}x it; {said}"
        )
    return "\n".join(out)


def table(result: dict) -> str:
    """The per-case table (GB/s = 1e9 B/s, medians) with descriptor counts and ratios."""
    head = (
        f"{'layout':20} {'tokens':>6} {'pattern':10} {'MB':>7} {'kvxferd':>7} {'(sc)':>6} "
        f"{'ceil':>6} {'ceil-pt':>7} {'perlay':>6} {'pl-busy':>7} {'ucx':>6} {'memcpy':>6} "
        f"{'tcp':>6} {'descs':>6} {'pl-descs':>8} {'kx/ceil':>7} {'kx/pl':>6}"
    )
    out = [head]
    for c in result["cases"]:
        out.append(
            f"{_label(c):20} {c['tokens']:>6} {c['pattern']:10} {c['bytes'] / 1e6:7.1f} "
            f"{_f(c['kvxferd_gbps'], '7.2f')} {_f(c['kvxferd_sidecar_gbps'])} "
            f"{_f(c['ceiling_gbps'])} {_f(c['ceiling_progress_gbps'], '7.2f')} "
            f"{_f(c['per_layer_gbps'])} {_f(c['per_layer_busy_gbps'], '7.2f')} "
            f"{_f(c['ucx_gbps'])} {_f(c['memcpy_gbps'])} {_f(c.get('tcp_kernel_gbps'))} "
            f"{c['kvxferd_descriptors']:>6} "
            f"{_f(c['per_layer_descriptors'], '>8')} {_f(c['kvxferd_vs_ceiling'], '7.2f')} "
            f"{_f(c['kvxferd_vs_per_layer'])}"
        )
    out.append(
        "GB/s medians. kvxferd: engine-side pull call to done (sc: sidecar-reported duration); "
        "ceil: 1 desc/region, busy-polling initiator; ceil-pt and perlay: initiator with a "
        "progress thread (sidecar/vLLM config); pl-busy: per-layer, busy-polling; tcp: the "
        "kernel's loopback TCP, no UCX (--tls sets other than default). *-reblock: the "
        "prefill's block sizes differ (tokens mapped); no per-layer scheme exists for it."
    )
    reasons = {c["ucx_reason"] for c in result["cases"] if c["ucx_gbps"] is None}
    for r in sorted(reasons):
        out.append(f"ucx column empty: {r}")
    return "\n".join(out)


def profile_table(result: dict) -> str:
    """Where a kvxferd pull spends its time (ms per pull, means over the timed pulls)."""
    keys = ("client", "sidecar_total", "claim", "post", "wire", "other", "plan_read")
    out = [f"{'layout':20} {'tokens':>6} {'pattern':10} " + " ".join(f"{k:>13}" for k in keys)]
    for c in result["cases"]:
        p = c["profile_ms"]
        out.append(
            f"{_label(c):20} {c['tokens']:>6} {c['pattern']:10} "
            + " ".join(f"{_f(p.get(k), '13.2f')}" for k in keys)
        )
    out.append(
        "ms per pull. client: pull call to done as the engine sees it; sidecar_total: the pull's "
        "own duration; claim: claim HTTP to prefill (concurrent with post and wire); post: "
        "address table + NIXL descriptor lists + initialize_xfer + post; wire: post to done; "
        "other: sidecar_total - max(claim, post + wire) (plan_read, handshake cache, notify); "
        "plan_read: the sidecar's per-pull planning (geometry cached per peer epoch) measured "
        "in-process."
    )
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    """Throughput vs request size, one panel per (layout, pattern)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    layouts = list(dict.fromkeys(_label(c) for c in cases))
    patterns = list(dict.fromkeys(c["pattern"] for c in cases))
    fig, axes = plt.subplots(
        len(layouts),
        len(patterns),
        squeeze=False,
        sharey=True,
        figsize=(5.5 * len(patterns), 3.6 * len(layouts)),
    )
    for i, layout in enumerate(layouts):
        for j, pattern in enumerate(patterns):
            ax = axes[i][j]
            sel = sorted(
                (c for c in cases if _label(c) == layout and c["pattern"] == pattern),
                key=lambda c: c["tokens"],
            )
            xs = [c["tokens"] for c in sel]
            for key, label, style in METHODS:
                ys = [c[key] if c[key] is not None else float("nan") for c in sel]
                ax.plot(xs, ys, style, marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{layout}, {pattern}")
            ax.set_xlabel("request tokens")
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"KV transfer throughput ({result['machine']['cpu_count']} CPUs, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
