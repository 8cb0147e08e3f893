"""Re-blocking end to end: prefill and decode whose block sizes differ, byte-exact over real NIXL.

vLLM unifies a hybrid's attention block with its Mamba page, so block sizes follow TP and the
attention pack size. Three pairs, each with its own ``kvxferd serve`` processes and pools:

- Nemotron-3-Nano-like Mamba2 hybrid (2 KV heads, 64 SSM heads; cut to 8 layers), prefill
  TP 4 (1,056-token blocks, kernel 32) -> decode TP 1 (2,096, kernel 16): KV heads replicated
  on the prefill, SSM heads sliced;
- Qwen3.6-35B-A3B-like GDN hybrid (cut to 8 layers), attention pack size 4 (272-token blocks,
  7 groups) -> pack size 1 (1,056, kernel 32, 4 groups): the same layers grouped otherwise;
- dense llama-3.1-8b (cut to 4 layers), block 16 -> 32, pulling fewer tokens than prefilled.

The prefill writes the token pattern (bytes named by token, not block) into its blocks; the
decode pulls with its own block ids and the token count, then verifies every byte of every
token of every layer, part and TP unit, and that nothing outside those tokens changed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
import pytest

from kvxferd.errors import BlockIdError
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import token_footprint, verify_token_pattern, write_token_pattern
from kvxferd.wire import HoldRequest, Manifest, PullRequest, Ticket
from tests.sidecar.harness import (
    QUIET,
    EnginePool,
    ReleasedFeed,
    Sidecar,
    start_sidecars,
    wait_no_handles,
)

pytestmark = pytest.mark.nixl


def nano_like() -> dict:
    """Nemotron-3-Nano-30B-A3B's attention and Mamba2 geometry on 8 layers (4 M, 2 *, 2 -)."""
    return dict(load_hf_config("nemotron-h-8b"), hidden_size=2688, num_key_value_heads=2,
                mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                num_hidden_layers=8, hybrid_override_pattern="M-M*M-M*")  # fmt: skip


def qwen36_like() -> dict:
    """Qwen3.6-35B-A3B's attention and GDN geometry on 8 layers (2 full attention)."""
    base = load_hf_config("qwen3.5-397b-a17b")
    text = dict(base["text_config"], hidden_size=2048, num_hidden_layers=8,
                linear_num_value_heads=32)  # fmt: skip
    return dict(base, text_config=text)


def llama_4() -> dict:
    return dict(load_hf_config("llama-3.1-8b"), num_hidden_layers=4)


@dataclass(frozen=True)
class Pair:
    """A prefill (TP ``prefill_tp``, options) and a decode TP 1 engine of the same model."""

    name: str
    hf: dict
    prefill_tp: int
    prefill: dict
    decode: dict
    extra_tokens: int
    """Tokens past the decode's first block (so both sides' block boundaries are crossed)."""
    ask_fewer: int = 0
    """Tokens the decode leaves out of its pull (attention-only models)."""


PAIRS = [
    Pair("nano-tp4-to-tp1", nano_like(), 4, {}, {}, 100),
    Pair("qwen36-pack4-to-pack1", qwen36_like(), 1, {"attn_pack_size": 4}, {}, 300),
    Pair("llama-block16-to-32", llama_4(), 1, {"block_size": 16}, {"block_size": 32}, 21, 5),
]


def _manifest(hf: dict, num_blocks: int, **opts) -> Manifest:
    engine = f"t{uuid.uuid4().hex[:8]}"  # unique region names, as harness.plan does
    return plan_manifest(hf, PlanOptions(num_blocks=num_blocks, engine_id=engine, **opts))


def _ids(m: Manifest, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Fragmented ids (block 0 unused) at this side's block sizes: one per Mamba group."""
    counts = [1 if g.kind == "mamba" else -(-tokens // g.block_size) for g in m.groups]
    perm = rng.permutation(np.arange(1, m.num_blocks))
    out, start = [], 0
    for c in counts:
        out.append([int(b) for b in perm[start : start + c]])
        start += c
    return out


@dataclass
class Rank:
    sidecar: Sidecar
    manifest: Manifest
    pool: EnginePool


@pytest.fixture(scope="module", params=PAIRS, ids=[p.name for p in PAIRS])
def pair(request, tmp_path_factory):
    p: Pair = request.param
    probe = _manifest(p.hf, 4, **p.decode)
    tokens = max(g.block_size for g in probe.groups) + p.extra_tokens
    nb_d = 2 * sum(1 if g.kind == "mamba" else -(-tokens // g.block_size) for g in probe.groups)
    rprobe = _manifest(p.hf, 4, tp_size=p.prefill_tp, **p.prefill)
    nb_p = 2 * sum(1 if g.kind == "mamba" else -(-tokens // g.block_size) for g in rprobe.groups)
    manifests = [_manifest(p.hf, nb_d + 1, **p.decode)]
    manifests += [_manifest(p.hf, nb_p + 1, tp_size=p.prefill_tp, tp_rank=r, **p.prefill)
                  for r in range(p.prefill_tp)]  # fmt: skip
    assert manifests[0].groups[0].block_size != manifests[1].groups[0].block_size
    names = ["decode"] + [f"prefill-r{r}" for r in range(p.prefill_tp)]
    tmp = str(tmp_path_factory.mktemp(f"reblock-{p.name}"))
    sidecars = start_sidecars(tmp, names, env=QUIET)
    pools = [EnginePool(m) for m in manifests]
    try:
        ranks = []
        for s, m, pool in zip(sidecars, manifests, pools, strict=True):
            with s.client() as c:
                c.register(m, pool.specs())
            ranks.append(Rank(s, m, pool))
        yield p, tokens, ranks[0], ranks[1:]
    finally:
        codes = [s.stop() for s in sidecars]
        for pool in pools:
            pool.close()
    assert codes == [0] * len(sidecars)


def _hold(rank: Rank, ids: list[list[int]], tokens: int, seed: int) -> Ticket:
    write_token_pattern(rank.manifest, rank.pool.views, ids, tokens, seed=seed)
    with rank.sidecar.client() as c:
        return c.hold(HoldRequest(request_id=f"req-{seed}", block_ids=ids, num_tokens=tokens))


def test_decode_pulls_tokens_into_its_own_blocks_byte_exact(pair):
    p, tokens, decode, prefill = pair
    rng = np.random.default_rng(13)
    rids = _ids(prefill[0].manifest, tokens, rng)
    tickets = [_hold(r, rids, tokens, seed=13) for r in prefill]
    want = tokens - p.ask_fewer
    lids = _ids(decode.manifest, want, rng)
    before = decode.pool.snapshot()
    with decode.sidecar.client() as c:
        req = PullRequest(tickets=tickets, block_ids=lids, num_tokens=want, deadline_s=60)
        status = c.wait_pull(c.pull(req).pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_token_pattern(decode.manifest, decode.pool.views, lids, want, seed=13) is None
    mask = token_footprint(decode.manifest, lids, want)
    for b, a, m in zip(before, decode.pool.views, mask, strict=True):
        assert int(((b != a) & ~m).sum()) == 0, "a byte outside the asked tokens changed"
    # every byte the decode needed came over the wire, once
    assert status.kv_bytes + status.state_bytes == sum(int(m.sum()) for m in mask)
    for rank, ticket in zip(prefill, tickets, strict=True):
        assert ReleasedFeed(rank.sidecar).wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
    wait_no_handles(decode.sidecar, *(r.sidecar for r in prefill))


def test_tokens_without_a_local_block_fail_the_pull_naming_the_ids(pair):
    p, tokens, decode, prefill = pair
    rng = np.random.default_rng(29)
    rids = _ids(prefill[0].manifest, tokens, rng)
    tickets = [_hold(r, rids, tokens, seed=29) for r in prefill]
    lids = _ids(decode.manifest, tokens, rng)
    short = [ids[:-1] if len(ids) > 1 else ids for ids in lids]  # too few blocks for the tokens
    with decode.sidecar.client() as c:
        req = PullRequest(tickets=tickets, block_ids=short, num_tokens=tokens, deadline_s=30)
        status = c.wait_pull(c.pull(req).pull_id, timeout_s=60)
    assert status.state == "failed"
    assert status.reason == "block_ids" and "block_ids[" in status.detail


def test_without_a_token_count_other_id_counts_are_a_422(pair):
    """num_tokens -1 pairs ids one to one (as between equal block sizes): counts must match."""
    p, tokens, decode, prefill = pair
    rng = np.random.default_rng(31)
    rids = _ids(prefill[0].manifest, tokens, rng)
    tickets = [_hold(r, rids, tokens, seed=31) for r in prefill]
    lids = _ids(decode.manifest, tokens, rng)
    assert [len(g) for g in lids] != [len(g) for g in rids]
    with decode.sidecar.client() as c, pytest.raises(BlockIdError) as info:
        c.pull(PullRequest(tickets=tickets, block_ids=lids, deadline_s=30))
    assert info.value.field.startswith(("block_ids[", "tickets[0].block_ids"))


def test_asking_more_tokens_than_were_prefilled_is_a_422(pair):
    p, tokens, decode, prefill = pair
    rng = np.random.default_rng(37)
    rids = _ids(prefill[0].manifest, tokens, rng)
    tickets = [_hold(r, rids, tokens, seed=37) for r in prefill]
    lids = _ids(decode.manifest, tokens + 1, rng)
    with decode.sidecar.client() as c, pytest.raises(BlockIdError) as info:
        c.pull(PullRequest(tickets=tickets, block_ids=lids, num_tokens=tokens + 1))
    assert info.value.field == "num_tokens"
