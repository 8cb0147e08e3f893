"""The token pattern: bytes named by token, so sides with different block sizes agree.

A plan is applied in-process (numpy copies of each descriptor) between pools of planned
manifests; the decode's pool must then verify, and only its footprint may have changed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.descriptors import plan_pull, read_geometry
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import token_footprint, verify_token_pattern, write_token_pattern
from kvxferd.wire import Manifest


def _plan(name: str, **opts) -> Manifest:
    return plan_manifest(load_hf_config(name), PlanOptions(num_blocks=24, **opts))


def _pool(m: Manifest) -> list[np.ndarray]:
    return [np.full(r.size_bytes, 0xA5, dtype=np.uint8) for r in m.regions]


def _ids(m: Manifest, tokens: int, first: int) -> list[list[int]]:
    out, nxt = [], first
    for g in m.groups:
        k = 1 if g.kind == "mamba" else -(-tokens // g.block_size)
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    return out


def _apply(plan, local: list[np.ndarray], remote: list[np.ndarray]) -> None:
    for lr, lo, rr, ro, n in zip(plan.local_region, plan.local_offset, plan.remote_region,
                                 plan.remote_offset, plan.length, strict=True):  # fmt: skip
        local[lr][lo : lo + n] = remote[rr][ro : ro + n]


@pytest.mark.parametrize(
    ("name", "prefill", "decode"),
    [
        ("falcon-h1-0.5b", {"tp_size": 4}, {}),
        ("qwen3-next-80b-a3b", {"attn_pack_size": 4}, {}),
        ("llama-3.1-8b", {"block_size": 16}, {"block_size": 32}),
    ],
)
def test_a_re_blocked_pull_verifies_and_writes_only_the_tokens(name, prefill, decode):
    tp = prefill.get("tp_size", 1)
    remotes = [_plan(name, **{**prefill, "tp_rank": r}) for r in range(tp)]
    local = _plan(name, **decode)
    n = max(g.block_size for g in local.groups) + 5
    rids, lids = _ids(remotes[0], n, 1), _ids(local, n, 2)
    lpool = _pool(local)
    before = [a.copy() for a in lpool]
    assert verify_token_pattern(local, lpool, lids, n, seed=7) is not None
    for remote in remotes:
        rpool = _pool(remote)
        write_token_pattern(remote, rpool, rids, n, seed=7)
        _apply(plan_pull(read_geometry(local, remote), lids, rids, -1, n), lpool, rpool)
    assert verify_token_pattern(local, lpool, lids, n, seed=7) is None
    mask = token_footprint(local, lids, n)
    for b, a, m in zip(before, lpool, mask, strict=True):
        assert not ((b != a) & ~m).any()
    # one wrong byte is found, named by part and block
    r = next(i for i, m in enumerate(mask) if m.any())
    at = int(np.flatnonzero(mask[r])[-1])
    lpool[r][at] ^= 0xFF
    bad = verify_token_pattern(local, lpool, lids, n, seed=7)
    assert bad is not None and bad.address == at and bad.region == r
