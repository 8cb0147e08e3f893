"""A HoldTable under a fake clock, for the hold tests: the table, a manifest and requests."""

from __future__ import annotations

from kvxferd.sidecar.holds import HoldTable
from kvxferd.wire import Group, HoldRequest, Manifest, Region

NUM_BLOCKS = 16
RES = 0.05 + 1e-9  # the reap resolution: the reaper wakes within it of a deadline


class FakeClock:
    """Time that moves only when the test says so."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def manifest(num_groups=2):
    groups = [Group(kind="full_attention", block_size=16, kernel_block_size=16, layers=[])]
    return Manifest(
        model="m",
        num_blocks=NUM_BLOCKS,
        regions=[Region(name="r", size_bytes=1, num_blocks=NUM_BLOCKS, page_bytes=1)],
        groups=groups * num_groups,
    )


def table(clock=None, **kw):
    kw = {"default_lease_s": 30.0, "max_lease_s": 100.0, "max_claim_s": 60.0, **kw}
    return HoldTable(manifest(), clock=clock or FakeClock(), **kw)


def req(request_id="r1", block_ids=None, lease_s=None, num_tokens=32, hold_id=""):
    return HoldRequest(
        request_id=request_id,
        block_ids=[[1, 2], [3]] if block_ids is None else block_ids,
        num_tokens=num_tokens,
        lease_s=lease_s,
        hold_id=hold_id,
    )
