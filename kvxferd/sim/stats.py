"""Counters of one simulated engine, served as JSON by ``GET /v1/stats``.

Monotonic counts, except the ``blocks_*`` and ``holds_outstanding`` gauges which are read from
the pool when the stats are taken. Changed only from the engine's event loop (no lock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SimStats:
    """What ``/v1/stats`` reports; the first fields are the issue-4 contract."""

    role: str
    requests: int = 0
    """Completion and chat requests received."""
    requests_failed: int = 0
    """Of those, answered with an error status."""
    pulls_ok: int = 0
    """Decode requests whose KV pull finished on every rank."""
    pulls_failed: int = 0
    """Decode requests whose pull failed on some rank."""
    recomputed: int = 0
    """Failed pulls followed by a local prefill (--on-pull-failure recompute)."""
    verified_ok: int = 0
    """Pulled requests whose every byte matched the pattern on every rank."""
    verified_failed: int = 0
    """Pulled requests with at least one wrong byte."""
    kv_bytes: int = 0
    """Attention bytes pulled (all ranks)."""
    state_bytes: int = 0
    """Mamba state bytes pulled (all ranks)."""
    transfer_seconds: float = 0.0
    """Sum over pulled requests of the pull's wall time (slowest rank)."""
    blocks_free: int = 0
    """Blocks on the free list now."""
    blocks_total: int = 0
    """Allocatable blocks (the pool minus the null block)."""
    holds_released: int = 0
    """Prefill requests whose holds every rank released (blocks freed)."""
    holds_expired: int = 0
    """Of those, released because a lease ran out on some rank (no decode read them)."""
    holds_outstanding: int = 0
    """Prefill requests still held for a decode."""
    holds_given_up: int = 0
    """Prefill requests whose holds were aborted because their decode will not read them
    (``POST /v1/kv/release``, e.g. from the proxy when the decode refused)."""
    tickets_minted: int = 0
    """Prefill requests answered with tickets the sim minted itself, their holds placed after
    the answer (kvxferd.sim.minting; the first request, and any after a failed placement, is
    held first)."""
    holds_failed: int = 0
    """Prefill requests answered with tickets minted here whose hold some rank then did not
    place (given up on every rank; their decodes recompute or fail)."""
    holds_unanswered: int = 0
    """Of those, ranks whose hold call and abort both got no answer: the blocks stay until the
    sidecar answers a later abort or its released feed reports the hold (kvxferd.sim.unanswered)."""
    holds_abandoned: int = 0
    """Of those, ranks whose sidecar stayed silent past the bound: blocks freed unconfirmed."""
    declined: int = 0
    """Decode requests refused or failed before reading, whose tickets were declined (the
    prefill holds released at once instead of at lease expiry)."""
    declines_failed: int = 0
    """Of those, declines the sidecar did not accept (logged; the holds then expire)."""
    local: int = 0
    """Requests computed locally (colocated, or without kv_transfer_params)."""
    blocks_pulled: int = 0
    """Local blocks written by pulls (prefix-cache hits are not pulled)."""
    blocks_cached: int = 0
    """Full attention blocks in the decode prefix cache now."""
    prefix_hits: int = 0
    """Blocks a decode took from its prefix cache instead of pulling."""
    prompt_tokens: int = 0
    """Prompt tokens of answered requests."""
    completion_tokens: int = 0
    """Generated tokens of answered requests."""
    store_lookups: int = 0
    """Prefill: prompts looked up in the store (--store)."""
    store_hit_tokens: int = 0
    """Prefill: prompt tokens loaded from the store and byte-verified instead of computed."""
    store_kv_bytes: int = 0
    """Prefill: attention bytes loaded from the store (all ranks)."""
    store_state_bytes: int = 0
    """Prefill: Mamba state bytes loaded from the store (all ranks)."""
    store_verified_ok: int = 0
    """Prefill: store loads whose every byte matched the pattern on every rank."""
    store_verified_failed: int = 0
    """Prefill: store loads with a wrong byte (then computed instead)."""
    store_loads_failed: int = 0
    """Prefill: store loads that failed (miss, corrupt entry; then computed instead)."""
    store_saves: int = 0
    """Prefill: computed prompts saved to the store on every rank."""
    store_save_failed: int = 0
    """Prefill: saves that failed on some rank."""

    def as_dict(self) -> dict[str, object]:
        """The JSON object of ``/v1/stats``."""
        return asdict(self)
