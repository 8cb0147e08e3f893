"""Prometheus metrics of one sidecar, built against an injected registry.

Names follow ``kvxferd_<subsystem>_<what>_<unit>``; every label has a small fixed value set (no
request, hold or peer ids as labels).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvxferd import __version__

# Seconds: from a 4 KiB loopback READ (~10 us) to a stuck multi-GB pull.
_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0)  # fmt: skip
_DESCRIPTORS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
# Bytes per second (base unit, as promtool's lint wants): 100 MB/s (TCP) to 400 GB/s (NVLink).
_BYTES_PER_S = tuple(g * 1e9 for g in (0.1, 0.5, 1, 2, 4, 8, 12, 16, 25, 50, 100, 200, 400))

PHASES = ("handshake", "claim", "post", "wire", "notify", "total")
"""Pull phases timed by kvxferd_pull_phase_duration_seconds."""
BYTE_KINDS = ("kv", "state")
"""kv: attention K/V bytes; state: Mamba conv/SSM bytes."""
EXPIRING_CALLS = ("hold", "pull", "store_save", "store_load")
"""Engine calls stamped with ``not_after_ns`` (label ``op`` of kvxferd_engine_calls_expired)."""


class Metrics:
    """All metric objects of a sidecar; pass ``registry`` to isolate (tests, several sidecars)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.transfer_bytes = Counter(
            "kvxferd_transfer_bytes", "Bytes pulled into this rank", ["kind"], registry=r
        )
        self.transfer_duration = Histogram(
            "kvxferd_transfer_duration_seconds",
            "Wall time of one NIXL READ from post to completion",
            buckets=_SECONDS,
            registry=r,
        )
        self.phase_duration = Histogram(
            "kvxferd_pull_phase_duration_seconds",
            "Time spent in each phase of a pull",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.transfer_descriptors = Histogram(
            "kvxferd_transfer_descriptors",
            "Descriptors posted per READ",
            buckets=_DESCRIPTORS,
            registry=r,
        )
        self.transfer_throughput = Histogram(
            "kvxferd_transfer_throughput_bytes_per_second",
            "Effective bytes/s of each READ (bytes / wall time)",
            buckets=_BYTES_PER_S,
            registry=r,
        )
        self.pulls = Counter("kvxferd_pulls", "Pulls finished, by outcome", ["outcome"], registry=r)
        self.pull_failures = Counter(
            "kvxferd_pull_failures", "Failed pulls by reason", ["reason"], registry=r
        )
        self.pulls_in_flight = Gauge(
            "kvxferd_pulls_in_flight", "Pulls accepted and not yet finished", registry=r
        )
        self.holds_active = Gauge(
            "kvxferd_holds_active", "Holds currently pinning blocks", registry=r
        )
        self.holds_created = Counter("kvxferd_holds_created", "Holds created", registry=r)
        self.calls_expired = Counter(
            "kvxferd_engine_calls_expired",
            "Engine calls refused because they came after their not_after_ns (a stalled sidecar)",
            ["op"],
            registry=r,
        )
        for op in EXPIRING_CALLS:
            self.calls_expired.labels(op)
        self.holds_released = Counter(
            "kvxferd_holds_released", "Holds released, by reason", ["reason"], registry=r
        )
        self.lease_headroom = Histogram(
            "kvxferd_hold_lease_headroom_seconds",
            "Lease time left when a hold was claimed (low values: leases too short)",
            buckets=_SECONDS,
            registry=r,
        )
        self.handshakes = Counter(
            "kvxferd_handshakes", "Handshakes by outcome", ["outcome"], registry=r
        )
        self.peers = Gauge("kvxferd_peers", "Remote peers with loaded NIXL metadata", registry=r)
        self.peer_calls = Counter(
            "kvxferd_peer_calls",
            "Calls to prefill sidecars answered, by call (claim, heartbeat, decline) and wire "
            "(frames: the signed framed port; http)",
            ["call", "wire"],
            registry=r,
        )
        self.peer_epochs = Counter(
            "kvxferd_peer_epochs_seen", "Distinct (engine, epoch) pairs handshaken", registry=r
        )
        self.nixl_handles = Gauge(
            "kvxferd_nixl_handles",
            "Live NIXL transfer handles (READs not yet released)",
            registry=r,
        )
        self.prepped_lists = Gauge(
            "kvxferd_prepped_lists",
            "Prepared NIXL descriptor lists (two per peer epoch and registration, bounded)",
            registry=r,
        )
        self.reads = Counter(
            "kvxferd_reads",
            "READs completed, by path: prepped (indices into a peer's prepared lists), tables "
            "(coalesced descriptor tables) or staged (whole runs into the staging buffer, "
            "then scattered)",
            ["path"],
            registry=r,
        )
        self.read_failures = Counter(
            "kvxferd_read_failures",
            "READs that failed, by path as kvxferd_reads: errored, not completed by the pull's "
            "deadline, their peer gone, not confirmed stopped, or (staged) not scattered; not "
            "one its pull gave up earlier (its claim failed or ended, another rank failed)",
            ["path"],
            registry=r,
        )
        self.staging_retired_bytes = Gauge(
            "kvxferd_staging_retired_bytes",
            "Bytes of the staging buffer retired: under READs that could not be confirmed "
            "stopped, handed out again once the READ ended, or, for one given up, once the "
            "buffer is released (staged READs that find no room read direct)",
            registry=r,
        )
        self.notification_polls_failed = Counter(
            "kvxferd_notification_polls_failed",
            "Reads of NIXL notifications that failed (a sender's agent name not UTF-8): the "
            "notifications read with it are lost, their holds end with their claims or leases",
            registry=r,
        )
        self.fabric_transports = Gauge(
            "kvxferd_fabric_transport",
            "UCX transports seen (1), by lane (reads, messages), endpoint kind and transport kind",
            ["lane", "endpoint", "transport"],
            registry=r,
        )
        self.request_body_bytes = Gauge(
            "kvxferd_request_body_bytes",
            "Bytes of request bodies and frame payloads an API holds now, by api (engine, peer); "
            "at most max_body_bytes_in_flight each",
            ["api"],
            registry=r,
        )
        self.info = Info("kvxferd_build", "Version and NIXL backend in use", registry=r)
        self.info.info({"version": __version__, "backend": ""})
        for kind in BYTE_KINDS:
            self.transfer_bytes.labels(kind)
        for phase in PHASES:
            self.phase_duration.labels(phase)
        for api in ("engine", "peer"):
            self.request_body_bytes.labels(api)
        add_store_metrics(self, r)
        self._released_seen: dict[str, int] = {}  # release counts already counted, by reason

    def count_releases(self, released: dict[str, int]) -> None:
        """Bring ``kvxferd_holds_released`` up to the hold table's release counts by reason."""
        seen = self._released_seen
        for reason, count in released.items():
            delta = count - seen.get(reason, 0)
            if delta > 0:
                self.holds_released.labels(reason).inc(delta)
                seen[reason] = count

    def peers_changed(self, count: int, new_epoch: bool) -> None:
        """Remote peers with loaded metadata now ``count``; ``new_epoch``: one more seen."""
        self.peers.set(count)
        if new_epoch:
            self.peer_epochs.inc()

    def set_backend(self, backend: str) -> None:
        """Record which NIXL backend carries transfers."""
        self.info.info({"version": __version__, "backend": backend})


STORE_TIERS = ("dram", "file")
"""The store's tiers (label ``tier``)."""


def add_store_metrics(m: Metrics, r: CollectorRegistry) -> None:
    """The store's (offload tier, issue 12) metrics, as attributes of ``m``."""
    m.store_lookup_tokens = Counter(
        "kvxferd_store_lookup_tokens",
        "Prompt tokens looked up in the store: hit (matched) or miss (hit rate = hit / all)",
        ["result"],
        registry=r,
    )
    m.store_bytes = Counter(
        "kvxferd_store_bytes", "Entry bytes saved to or loaded from each store tier",
        ["tier", "op"], registry=r,
    )  # fmt: skip
    m.store_resident_bytes = Gauge(
        "kvxferd_store_resident_bytes", "Bytes held by each store tier", ["tier"], registry=r
    )
    m.store_evictions = Counter(
        "kvxferd_store_evictions", "Store entries evicted (LRU) per tier", ["tier"], registry=r
    )
    m.store_corrupt = Counter(
        "kvxferd_store_corrupt_entries",
        "Store entries that failed their checksums (deleted, never loaded)",
        ["tier"],
        registry=r,
    )
    m.store_loads = Counter(
        "kvxferd_store_loads", "Store loads finished, by outcome", ["outcome"], registry=r
    )
    m.store_disagreements = Counter(
        "kvxferd_store_group_disagreements",
        "Lookups whose groups matched different prefixes (the minimum was used)",
        registry=r,
    )
    for result in ("hit", "miss"):
        m.store_lookup_tokens.labels(result)
    for tier in STORE_TIERS:
        m.store_resident_bytes.labels(tier)
        m.store_evictions.labels(tier)
        m.store_corrupt.labels(tier)
        for op in ("save", "load"):
            m.store_bytes.labels(tier, op)
