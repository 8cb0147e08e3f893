"""The store options of the connector and their order against a remote prefill, through vLLM's
real v1 Scheduler (the lookup answered by a stand-in: only the scheduler's decision is tested
here; test_store.py moves real bytes)."""

from __future__ import annotations

import pytest

from kvxferd.errors import ConfigError
from kvxferd.vllm.storeplan import StoreOptions, StorePlanner
from kvxferd.wire import Identity, StoreLookup
from tests.vllm.ranks import request, step

SECRET = "store-order-secret"
N = 300


def test_options_default_to_off_and_name_the_bad_key():
    assert StoreOptions.from_extra({}) == StoreOptions(mode="off", order="remote_first")
    both = StoreOptions.from_extra({"store": "both", "store_order": "store_first"})
    assert both.load and both.save and both.order == "store_first"
    assert not StoreOptions.from_extra({"store": "save"}).load
    for extra, key in [
        ({"store": "on"}, "store"),
        ({"store_order": "store"}, "store_order"),
        ({"store_chunk_tokens": 0}, "store_chunk_tokens"),
        ({"store_lookup_timeout_s": "soon"}, "store_lookup_timeout_s"),
    ]:
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}:"):
            StoreOptions.from_extra(extra)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "inf", "nan", 1.5])
def test_a_lookup_timeout_that_is_no_bound_or_a_chunk_not_whole_is_refused_naming_it(value):
    """Taken, an infinite or NaN timeout made every lookup raise OverflowError or ValueError
    from the client (not a KvxferdError: out of vLLM's scheduler, stopping the engine). A chunk
    size is whole tokens: 1.5 was read as 1, not the sidecar's chunk."""
    key = "store_chunk_tokens" if value == 1.5 else "store_lookup_timeout_s"
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}:"):
        StoreOptions.from_extra({key: value})


def test_a_sliding_windows_null_blocks_are_never_saved_as_data():
    """vLLM hands a sliding-window group's evicted blocks over as its null block 0: the save
    names them -1 (not stored), the full-attention group keeps its blocks, Mamba its state."""

    class Finished:
        request_id, status, num_computed_tokens = "r", "FINISHED_LENGTH_CAPPED", 64
        all_token_ids = list(range(70))

    kinds = ["attention", "attention", "mamba"]
    options = StoreOptions(mode="save", order="remote_first")
    planner = StorePlanner(options, lambda r: None, root=b"m", kinds=kinds, block_size=16)
    order = planner.save(Finished(), [[0, 0, 7, 8, 9], [1, 2, 3, 4, 5], [0, 0, 11]])
    assert order is not None
    assert order.block_ids == [[-1, -1, 7, 8], [1, 2, 3, 4], [11]]


def _request(rid: str, **kw):
    """A real vLLM Request of 200 tokens, finished normally with all of them computed."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    req = Request(rid, list(range(1, 201)), SamplingParams(max_tokens=1), None, **kw)
    req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 200
    return req


class Keys:
    """Stands in for rank 0's lookup: records the keys asked for, answers a whole hit."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def __call__(self, req):  # noqa: ANN001, ANN204
        self.asked.append(req.keys)
        return StoreLookup(matched_tokens=[req.num_tokens], matched=req.num_tokens)


def test_a_cache_salt_keys_its_own_entries():
    """The same prompt under two salts, and under none, is three sets of keys on lookup and on
    save: a salted tenant never loads another's entries (vLLM's own prefix cache isolates
    them the same way)."""
    keys = Keys()
    planner = StorePlanner(StoreOptions(mode="both"), keys, root=b"m", kinds=None, block_size=16)
    reqs = [_request("a", cache_salt="tenant-a"), _request("b", cache_salt="tenant-b"),
            _request("n")]  # fmt: skip
    assert [planner.match(r) for r in reqs] == [200, 200, 200]
    assert len({tuple(k) for k in keys.asked}) == 3
    saved = [planner.save(r, [[1] * 13]) for r in reqs]
    assert [s.keys for s in saved if s is not None] == keys.asked


def test_requests_whose_bytes_the_tokens_do_not_show_skip_the_store():
    """A LoRA adapter, images behind placeholder tokens and prompt embeddings change the KV
    bytes of the same token ids: such a request is neither looked up nor saved."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                  mm_position=PlaceholderRange(offset=0, length=4))  # fmt: skip
    keys = Keys()
    planner = StorePlanner(StoreOptions(mode="both"), keys, root=b"m", kinds=None, block_size=16)
    for req in [
        _request("lora", lora_request=LoRARequest("adapter", 1, "/adapters/a")),
        _request("mm", mm_features=[image]),
        _request("embeds", prompt_embeds=torch.zeros(200, 8)),
    ]:
        assert planner.match(req) == 0, req.request_id
        assert planner.save(req, [[1] * 13]) is None, req.request_id
    assert keys.asked == []
    assert planner.match(_request("plain")) == 200  # the stand-in would have served them


def test_engines_that_compute_different_bytes_key_different_entries(engines, monkeypatch):
    """The keys' root names the model's revision, weights and cache dtypes: fp8_e4m3 and
    fp8_e5m2 caches (one manifest dtype, uint8) or another revision never share entries; the
    same setup always gives the same root (another process finds its entries)."""
    from kvxferd.vllm.connector import store_root

    config = engines("dense", num_blocks=32).config
    base = store_root(config)
    assert store_root(config) == base
    roots = {base}
    for obj, name, value in [
        (config.cache_config, "cache_dtype", "fp8_e4m3"),
        (config.cache_config, "cache_dtype", "fp8_e5m2"),
        (config.model_config, "revision", "v2"),
        (config.model_config, "quantization", "fp8"),
    ]:
        with monkeypatch.context() as m:
            m.setattr(obj, name, value)
            roots.add(store_root(config))
    assert len(roots) == 5
    assert store_root(config) == base


class Lookups:
    """Stands in for rank 0's lookup: the store holds ``hit`` tokens of every prompt."""

    def __init__(self, hit: int | None) -> None:
        self.hit, self.calls = hit, 0

    def __call__(self, req):  # noqa: ANN001, ANN204
        self.calls += 1
        matched = req.num_tokens if self.hit is None else min(self.hit, req.num_tokens)
        return StoreLookup(matched_tokens=[matched], matched=matched)


def _scheduler(engine, lookups: Lookups):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    sched = Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )
    ident = Identity(engine_id="P", epoch=3, generation=0, peer_address="127.0.0.1:9",
                     tp_rank=0, tp_size=1, default_lease_s=30.0)  # fmt: skip
    sched.connector._sched._known = [ident]
    sched.connector._sched.store._lookup = lookups
    return sched


@pytest.mark.parametrize(
    "order,hit,source",
    [
        ("remote_first", None, "remote"),
        ("store_first", None, "store"),
        ("store_first", 128, "remote"),
    ],  # fmt: skip
)
def test_store_order_picks_the_remote_prefill_or_a_whole_prompt_store_hit(
    engines, monkeypatch, order, hit, source
):
    """remote_first: remote params are pulled and the store is not asked. store_first: a hit on
    the whole prompt loads from the store and declines the tickets (the prefill frees its hold
    at once); a shorter hit still pulls."""
    from vllm.v1.outputs import KVConnectorOutput

    monkeypatch.setenv("KVXFERD_PEER_TOKEN", SECRET)
    engine = engines("dense", num_blocks=32)
    cfg = engine.config.kv_transfer_config
    extra = {**cfg.kv_connector_extra_config, "store": "load", "store_order": order}
    monkeypatch.setattr(cfg, "kv_connector_extra_config", extra)
    prefill = _scheduler(engine, Lookups(0))  # a miss: the prefill computes
    prefill.add_request(request("p", N, {"do_remote_decode": True}))
    _, engine_out = step(prefill)
    params = next(o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
                  if o.kv_transfer_params)  # fmt: skip

    lookups = Lookups(hit)
    decode = _scheduler(engine, lookups)
    decode.add_request(request("d", N, dict(params)))
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    assert lookups.calls == (0 if order == "remote_first" else 1)
    if source == "remote":
        assert [p.request_id for p in orders.pulls] == ["d"]
        assert orders.loads == [] and orders.declines == []
    else:
        assert orders.pulls == []
        assert [(ld.request_id, ld.num_tokens) for ld in orders.loads] == [("d", N)]
        assert [(d.tickets, d.reason) for d in orders.declines] == [
            (params["kvxferd_tickets"], "store_hit")
        ]
    step(decode, KVConnectorOutput(finished_recving={"d"}))
    out, _ = step(decode)
    assert out.num_scheduled_tokens.get("d", 0) == 1  # loaded either way: only the tail
    assert out.kv_connector_metadata.orders.declines == []  # declined once, never again


def test_a_failed_lookup_is_a_miss_and_the_engine_computes(engines, monkeypatch, caplog):
    from kvxferd.client import SidecarUnreachableError

    def down(req):  # noqa: ANN001, ANN202
        raise SidecarUnreachableError("POST /v1/store/lookup: connection refused")

    engine = engines("dense", num_blocks=32)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config",
                        {**cfg.kv_connector_extra_config, "store": "both"})  # fmt: skip
    sched = _scheduler(engine, Lookups(None))
    sched.connector._sched.store._lookup = down
    sched.add_request(request("r", N, None))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r": N}
    assert out.kv_connector_metadata.orders.loads == []
    assert "store lookup for 'r' failed" in caplog.text


def test_a_store_hit_left_by_an_allocation_that_failed_is_not_loaded_after_a_local_hit(
    engines, monkeypatch
):
    """store_first: the store matched a request vLLM could not allocate yet; by its next try a
    running request had cached its first blocks locally, so the store is not asked again and
    the remote prefill pulls only the rest. Before, the first try's hit was still kept and
    loaded in place of that pull: a load from token 0, over the locally cached blocks other
    requests share (or, its count differing, every block a load error and the pull lost)."""
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", SECRET)
    engine = engines("dense", num_blocks=9)  # 8 usable blocks of 128 tokens
    cfg = engine.config.kv_transfer_config
    extra = {**cfg.kv_connector_extra_config, "store": "load", "store_order": "store_first"}
    monkeypatch.setattr(cfg, "kv_connector_extra_config", extra)
    prompt = list(range(1, 101)) + [7] * 200  # 7: the token every step samples
    prefill = _scheduler(engine, Lookups(0))
    prefill.add_request(request("p", N, {"do_remote_decode": True}, prompt=prompt))
    _, engine_out = step(prefill)
    params = next(o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
                  if o.kv_transfer_params)  # fmt: skip

    lookups = Lookups(0)  # r and big miss; d is then matched whole
    decode = _scheduler(engine, lookups)
    # "r" ends at 128 tokens of d's prompt: its one block then cached, and freed.
    decode.add_request(request("r", 100, None, prompt=prompt[:100], max_tokens=29))
    decode.add_request(request("big", 600, None, prompt=list(range(5001, 5601)), max_tokens=99))
    step(decode)  # r: 1 block, big: 5 blocks; 2 left, d needs 3 for a store load
    lookups.hit = None
    decode.add_request(request("d", N, dict(params), prompt=prompt))
    loads, pulls = [], []
    for _ in range(80):
        out, _ = step(decode)
        orders = out.kv_connector_metadata.orders
        loads += [ld for ld in orders.loads if ld.request_id == "d"]
        pulls += [p for p in orders.pulls if p.request_id == "d"]
        if loads or pulls:
            break
    assert loads == []
    assert len(pulls) == 1 and pulls[0].block_ids[0][0] == -1  # the rest only
