"""The real vLLM v1 Scheduler drives KvxferdConnector: a finished prefill answers its params at
once with one minted ticket per rank; a decode with those params loads asynchronously."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvxferd.client import SidecarUnreachableError
from kvxferd.sidecar.tickets import verify_ticket
from kvxferd.vllm import scheduler as scheduler_module
from kvxferd.wire import Identity, Ticket
from tests.vllm.ranks import prefill_side, request, step

SECRET = b"test-secret"


def _scheduler(engine, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setenv("KVXFERD_PEER_TOKEN", SECRET.decode())
    sched = Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )
    ident = Identity(engine_id="P", epoch=7, generation=0, peer_address="127.0.0.1:9",
                     tp_rank=0, tp_size=1, default_lease_s=30.0)  # fmt: skip
    sched.connector._sched._known = [ident]
    return sched


@pytest.mark.parametrize("model", ["dense", "nemotron-h", "qwen3-next"])
def test_prefill_then_decode_through_the_real_scheduler(engines, model, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: F401
    from vllm.v1.outputs import KVConnectorOutput

    engine = engines(model, num_blocks=32)
    prefill = _scheduler(engine, monkeypatch)
    n = 300
    prefill.add_request(request("p1", n, {"do_remote_decode": True}))
    out, engine_out = step(prefill)
    meta = out.kv_connector_metadata
    outputs = [o for eo in engine_out.values() for o in eo.outputs]
    params = next(o.kv_transfer_params for o in outputs if o.kv_transfer_params)
    assert params["do_remote_prefill"] and params["remote_engine_id"]
    tickets = [Ticket(**t) for t in params["kvxferd_tickets"]]
    verify_ticket(tickets[0], SECRET)
    hybrid = model != "dense"
    assert params["remote_num_tokens"] == (n - 1 if hybrid else n)
    # The hold is ordered in the next step's metadata, and the blocks stay allocated.
    out2, _ = step(prefill)
    holds = out2.kv_connector_metadata.orders.holds + meta.orders.holds
    assert [h.hold_id for h in holds] == [tickets[0].hold_id]
    assert all(0 not in ids for ids in holds[0].block_ids)
    free_before = prefill.kv_cache_manager.block_pool.get_num_free_blocks()
    step(prefill, KVConnectorOutput(finished_sending={"p1"}))
    assert prefill.kv_cache_manager.block_pool.get_num_free_blocks() > free_before

    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d1", n, dict(params)))
    out, _ = step(decode)
    from vllm.v1.request import RequestStatus

    req = decode.requests["d1"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pulls = out.kv_connector_metadata.orders.pulls
    assert len(pulls) == 1 and pulls[0].request_id == "d1"
    assert [len(g) for g in pulls[0].block_ids] == [len(g) for g in tickets[0].block_ids]
    step(decode, KVConnectorOutput(finished_recving={"d1"}))
    out, _ = step(decode)
    # Loaded: only the tail is computed (the last token; with partial prefill it was not sent).
    assert out.num_scheduled_tokens.get("d1", 0) == 1


@pytest.mark.parametrize("extra", [0, 1])
def test_a_hybrid_prefill_computes_all_but_the_last_token_and_the_decode_pairs_every_block(
    engines, monkeypatch, extra
):
    """With partial prefill the decode recomputes the prompt's last token, so the prefill must
    stop before it: computed to its end, the Mamba state shipped was already past that token
    (applied twice at the decode), and where ``n - 1`` ends a block the prefill's extra
    attention block shifted every pairing by one (the decode's first block got the second)."""
    engine = engines("nemotron-h", num_blocks=48)
    bs = engine.config.cache_config.block_size
    n = 2 * bs + extra
    prefill = _scheduler(engine, monkeypatch)
    prefill.add_request(request("p", n, {"do_remote_decode": True}))
    out, engine_out = step(prefill)
    assert out.num_scheduled_tokens["p"] == n - 1
    params = next(o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
                  if o.kv_transfer_params)  # fmt: skip
    assert params["remote_num_tokens"] == n - 1
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", n, dict(params)))
    out, _ = step(decode)
    pull = out.kv_connector_metadata.orders.pulls[0]
    local = decode.kv_cache_manager.get_block_ids("d")
    kinds = [type(g.kv_cache_spec).__name__ for g in engine.kv_cache_config.kv_cache_groups]
    for kind, targets, mine in zip(kinds, pull.block_ids, local, strict=True):
        live = [b for b in mine if b != 0]
        assert targets == (live[-1:] if kind == "MambaSpec" else live)


def _prefill_params(engine, monkeypatch, n: int) -> dict:
    prefill = _scheduler(engine, monkeypatch)
    prefill.add_request(request("p", n, {"do_remote_decode": True}))
    _, engine_out = step(prefill)
    outputs = [o for eo in engine_out.values() for o in eo.outputs]
    return next(o.kv_transfer_params for o in outputs if o.kv_transfer_params)


def test_a_decode_aborted_before_it_loads_declines_the_prefill_hold(engines, monkeypatch):
    from vllm.v1.request import RequestStatus

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)
    decode = _scheduler(engine, monkeypatch)
    free = decode.kv_cache_manager.block_pool.get_num_free_blocks()
    decode.add_request(request("d", 300, dict(params)))
    decode.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    declines = out.kv_connector_metadata.orders.declines
    assert [(d.tickets, d.reason) for d in declines] == [(params["kvxferd_tickets"], "aborted")]
    assert out.kv_connector_metadata.orders.pulls == []
    assert decode.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_a_decode_that_vllm_computes_locally_declines_the_prefill_hold(engines, monkeypatch):
    """vLLM reads no external tokens for a request that wants prompt logprobs: it computes the
    prompt itself, and the prefill's hold is released now instead of at its lease's end."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)
    decode = _scheduler(engine, monkeypatch)
    local = Request(
        request_id="d",
        prompt_token_ids=list(range(1, 301)),
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1),
        pooling_params=None,
    )
    local.kv_transfer_params = dict(params)
    decode.add_request(local)
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    assert out.num_scheduled_tokens.get("d") == 300 and orders.pulls == []
    declined = [(d.tickets, d.reason) for d in orders.declines]
    assert declined == [(params["kvxferd_tickets"], "computed_locally")]


def _queued_decode(engines, monkeypatch):
    """A decode engine whose 9 blocks a local request takes 8 of, and decode request "d"
    (3 blocks, with a prefill's tickets) waiting behind it; (scheduler, d's params)."""
    engine = engines("dense", num_blocks=10)  # the null block and 9 others
    params = _prefill_params(engine, monkeypatch, 300)
    decode = _scheduler(engine, monkeypatch)
    big = list(range(1000, 1900))  # shares no prefix with "d"
    decode.add_request(request("big", 900, None, prompt=big, max_tokens=100))
    decode.add_request(request("d", 300, dict(params)))
    return decode, params


def test_a_decode_request_vllm_queues_keeps_the_prefill_holds_alive_until_allocated(
    engines, monkeypatch
):
    """vLLM's scheduler tells the connector of each new request: while one with tickets waits
    for blocks, every keepalive that falls due sends its tickets; once allocated, none."""
    from vllm.v1.request import RequestStatus

    monkeypatch.setattr(scheduler_module, "KEEPALIVE_S", 0.0)  # due at every step
    decode, params = _queued_decode(engines, monkeypatch)
    for _ in range(3):
        out, _ = step(decode)
        assert "d" not in out.num_scheduled_tokens  # no blocks for it: it waits in the queue
        assert out.kv_connector_metadata.orders.keepalives == params["kvxferd_tickets"]
    decode.finish_requests("big", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    assert [p.request_id for p in orders.pulls] == ["d"] and orders.keepalives == []
    out, _ = step(decode)
    assert out.kv_connector_metadata.orders.keepalives == []


def test_keepalives_of_a_queued_decode_request_stop_after_keepalive_for_s(engines, monkeypatch):
    """The prefill's blocks are not the decode's to keep: past KEEPALIVE_FOR_S its holds end
    with their lease (the pull then fails and vLLM computes the request)."""
    monkeypatch.setattr(scheduler_module, "KEEPALIVE_S", 0.0)
    monkeypatch.setattr(scheduler_module, "KEEPALIVE_FOR_S", 0.0)
    decode, _ = _queued_decode(engines, monkeypatch)
    for _ in range(2):
        out, _ = step(decode)
        assert "d" not in out.num_scheduled_tokens
        assert out.kv_connector_metadata.orders.keepalives == []


def test_a_failed_load_frees_the_blocks_and_vllm_recomputes(engines, monkeypatch):
    from vllm.v1.outputs import KVConnectorOutput

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)
    monkeypatch.setattr(engine.config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", 300, dict(params)))
    out, _ = step(decode)
    pull = out.kv_connector_metadata.orders.pulls[0]
    bad = {b for g in pull.block_ids for b in g if b >= 0}
    step(decode, KVConnectorOutput(finished_recving={"d"}, invalid_block_ids=bad))
    out, _ = step(decode)
    # The blocks whose bytes never arrived are computed locally: the whole prompt is scheduled.
    assert out.num_scheduled_tokens.get("d", 0) == 300
    assert out.kv_connector_metadata.orders.pulls == []


def _ticket_with(params: dict, **fields) -> list[dict]:
    return [{**params["kvxferd_tickets"][0], **fields}]


# Params a client can send a decode's OpenAI port: (what changes, whether the tickets still
# parse, so the prefill's hold is declined at once).
BAD_PARAMS = {
    "remote_num_tokens a string": (lambda p: {"remote_num_tokens": "x"}, True),
    "remote_num_tokens beyond the prompt": (lambda p: {"remote_num_tokens": 10**9}, True),
    "remote_num_tokens negative": (lambda p: {"remote_num_tokens": -5}, True),
    "remote_num_tokens a bool": (lambda p: {"remote_num_tokens": True}, True),
    "remote_block_size zero": (lambda p: {"remote_block_size": 0}, True),
    "tickets with another group count": (
        lambda p: {"kvxferd_tickets": _ticket_with(p, block_ids=[[1, 2, 3], [4]])},
        True,
    ),
    "tickets not objects": (lambda p: {"kvxferd_tickets": [1]}, False),
    "tickets a string": (lambda p: {"kvxferd_tickets": "abc"}, False),
    "a ticket missing fields": (lambda p: {"kvxferd_tickets": [{"block_ids": [[1]]}]}, False),
    "a ticket with block ids of strings": (
        lambda p: {"kvxferd_tickets": _ticket_with(p, block_ids=[["1"]])},
        False,
    ),
    "a ticket whose request id has a newline": (
        lambda p: {"kvxferd_tickets": _ticket_with(p, request_id="p\nforged log line")},
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_params_from_a_client_are_computed_locally_not_raised_in_the_scheduler(
    engines, monkeypatch, case
):
    """An exception in vLLM's scheduler stops the engine for every request: params that do not
    check out are dropped, the request is computed locally, parsed tickets are declined."""
    change, parses = BAD_PARAMS[case]
    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)
    params.update(change(params))
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", 300, params))
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    assert out.num_scheduled_tokens.get("d") == 300
    assert orders.pulls == [] and orders.failed == []
    declined = [(d.tickets, d.reason) for d in orders.declines]
    assert declined == ([(params["kvxferd_tickets"], "malformed")] if parses else [])


@pytest.mark.parametrize("forged", [True, False])
def test_a_decode_promises_vllm_no_more_tokens_than_its_ticket_covers(engines, monkeypatch, forged):
    """``remote_num_tokens`` is the client's (unsigned) copy of the ticket's count: a decode
    that trusted it (or, without it, the whole prompt) told vLLM that tokens no READ writes
    were loaded, and vLLM then used and prefix-cached whatever those blocks held. A count the
    ticket contradicts is dropped (computed locally, declined); absent, the ticket's counts."""
    from vllm.v1.outputs import KVConnectorOutput

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 100)  # a ticket for 100 tokens, 1 block
    if forged:
        params["remote_num_tokens"] = 300
    else:
        del params["remote_num_tokens"]
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", 300, params))
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    if forged:
        assert out.num_scheduled_tokens.get("d") == 300 and orders.pulls == []
        assert [(d.tickets, d.reason) for d in orders.declines] == [
            (params["kvxferd_tickets"], "malformed")
        ]
        return
    assert [p.num_tokens for p in orders.pulls] == [100]
    assert [len(g) for g in orders.pulls[0].block_ids] == [1]
    step(decode, KVConnectorOutput(finished_recving={"d"}))
    out, _ = step(decode)
    assert out.num_scheduled_tokens.get("d") == 200  # the 200 tokens no ticket covers


@pytest.mark.parametrize("case", ["another prompt", "another first token", "no binding"])
def test_tickets_sent_with_a_prompt_they_were_not_computed_for_are_not_loaded(
    engines, monkeypatch, case
):
    """Tickets are signed but name no prompt: a decode that pulled them for any prompt a client
    sent cached the pulled blocks under that prompt's hashes, served to every later request
    sharing the prefix. The prefill binds them to its prompt; a decode whose own prompt does
    not match (or with no binding) computes the request locally and declines the tickets."""
    from kvxferd.vllm import binding

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)  # prompt 1..300
    prompt = list(range(1, 301))
    if case == "another prompt":
        prompt = list(range(1001, 1301))
    elif case == "another first token":
        prompt[0] = 999
    else:
        del params[binding.FIELD]
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", 300, params, prompt=prompt))
    out, _ = step(decode)
    orders = out.kv_connector_metadata.orders
    assert out.num_scheduled_tokens.get("d") == 300 and orders.pulls == []
    declined = [(d.tickets, d.reason) for d in orders.declines]
    assert declined == [(params["kvxferd_tickets"], "malformed")]


def test_a_decode_prompt_of_embeddings_with_tickets_is_computed_locally(engines, monkeypatch):
    """A prompt given as embeddings has no token ids (vLLM's ``prompt_token_ids`` is None):
    reading its params raised TypeError in vLLM's scheduler, which stops the engine; now its
    tickets bind to nothing it has, so it is computed locally and they are declined."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = engines("dense", num_blocks=32)
    params = _prefill_params(engine, monkeypatch, 300)
    decode = _scheduler(engine, monkeypatch)
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    req = Request("d", None, sampling, None, prompt_embeds=torch.zeros(300, 8))
    req.kv_transfer_params = params
    decode.add_request(req)
    out, _ = step(decode)
    assert out.num_scheduled_tokens.get("d") == 300
    assert [d.reason for d in out.kv_connector_metadata.orders.declines] == ["malformed"]


def test_a_prefill_prompt_of_embeddings_finishes_like_a_local_request(engines, monkeypatch):
    """No token ids to bind its tickets to: counting them raised TypeError in vLLM's scheduler
    as the request finished, which stops the engine; now it answers no params, frees at once."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = engines("dense", num_blocks=32)
    prefill = _scheduler(engine, monkeypatch)
    free = prefill.kv_cache_manager.block_pool.get_num_free_blocks()
    params = {"do_remote_decode": True}
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    req = Request("p", None, sampling, None, prompt_embeds=torch.zeros(300, 8))
    req.kv_transfer_params = params
    prefill.add_request(req)
    _, engine_out = step(prefill)
    assert [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs] == [None]
    out, _ = step(prefill)
    assert out.kv_connector_metadata.orders.holds == []
    assert prefill.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_an_aborted_request_with_malformed_tickets_declines_nothing(engines, monkeypatch):
    from vllm.v1.request import RequestStatus

    engine = engines("dense", num_blocks=32)
    params = {**_prefill_params(engine, monkeypatch, 300), "kvxferd_tickets": "abc"}
    decode = _scheduler(engine, monkeypatch)
    decode.add_request(request("d", 300, params))
    decode.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    assert out.kv_connector_metadata.orders.declines == []


@pytest.mark.parametrize("model", ["dense", "nemotron-h"])
def test_a_decode_prefix_cache_hit_pulls_only_the_blocks_it_lacks(engines, model, monkeypatch):
    from vllm.v1.request import RequestStatus

    engine = engines(model, num_blocks=48)
    bs = engine.config.cache_config.block_size
    n = 3 * bs + 44
    params = _prefill_params(engine, monkeypatch, n)
    decode = _scheduler(engine, monkeypatch)
    # A local request with the same first two blocks fills the decode's prefix cache.
    decode.add_request(request("local", 2 * bs + 10, None))
    step(decode)
    decode.finish_requests("local", RequestStatus.FINISHED_ABORTED)
    decode.add_request(request("d", n, dict(params)))
    out, _ = step(decode)
    pull = out.kv_connector_metadata.orders.pulls[0]
    kinds = [type(g.kv_cache_spec).__name__ for g in engine.kv_cache_config.kv_cache_groups]
    remote = params["kvxferd_tickets"][0]["block_ids"]
    for kind, local, theirs in zip(kinds, pull.block_ids, remote, strict=True):
        assert len(local) == len(theirs)
        if kind == "MambaSpec":  # one running state, pulled whole (no "one local block" limit)
            assert len(local) == 1 and local[0] > 0
        else:
            assert local[:2] == [-1, -1] and all(b > 0 for b in local[2:]), local


def test_reblocking_targets_name_the_decode_blocks_by_position():
    from kvxferd.vllm.scheduler import reblock_targets

    # 300 tokens at block size 64 need 5 blocks; the first 128 tokens are a prefix-cache hit
    # (-1), a sliding window's freed block is null (-1), Mamba keeps its state block only.
    kinds = ["attention", "attention", "mamba"]
    local = [[4, 5, 6, 7, 8, 9], [0, 0, 11, 12, 13, 14], [0, 0, 0, 0, 0, 21]]
    out = reblock_targets(kinds, local, num_tokens=300, block_size=64, done=128)
    assert out == [[-1, -1, 6, 7, 8], [-1, -1, 11, 12, 13], [21]]


def test_a_prefill_whose_sidecar_cannot_say_who_it_is_finishes_like_a_local_request(
    engines, monkeypatch
):
    """An exception in vLLM's scheduler would stop the engine: while the identities cannot be
    read (no sidecar listens on the socket), a finished prefill answers no params and its
    blocks are freed at once; once they can, holds are ordered again."""
    engine = engines("dense", num_blocks=32)
    prefill = _scheduler(engine, monkeypatch)
    side = prefill.connector._sched
    known, side._known = side._known, None  # read again: from a socket nobody listens on
    free = prefill.kv_cache_manager.block_pool.get_num_free_blocks()
    prefill.add_request(request("p1", 300, {"do_remote_decode": True}))
    _, engine_out = step(prefill)
    assert [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs] == [None]
    out, _ = step(prefill)
    assert out.kv_connector_metadata.orders.holds == []
    assert prefill.kv_cache_manager.block_pool.get_num_free_blocks() == free

    side._known = known  # the sidecar answers again
    prefill.add_request(request("p2", 300, {"do_remote_decode": True}))
    _, engine_out = step(prefill)
    params = [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs]
    assert len(params) == 1 and params[0]["kvxferd_tickets"]
    out, _ = step(prefill)
    assert [h.request_id for h in out.kv_connector_metadata.orders.holds] == ["p2"]


def test_a_hung_prefill_sidecar_is_asked_who_it_is_seldom_enough_not_to_stall_the_scheduler(
    monkeypatch,
):
    """Asking a hung sidecar blocks the scheduler until the client's timeout: the next ask waits
    ten times as long as that one took (one second after a quick refusal)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    asks: list[float] = []

    def identities():
        asks.append(clock.now)
        clock.now += 5.0 if len(asks) == 1 else 0.01  # the first ask hangs until its timeout
        raise SidecarUnreachableError("GET /v1/identity: no answer in time (5 s)")

    side = prefill_side(identities, 128)
    assert side._minting() is None and asks == [0.0]
    clock.now = 54.9
    assert side._minting() is None and asks == [0.0]  # not before 5 s + 10 x 5 s
    clock.now = 55.0
    assert side._minting() is None and asks == [0.0, 55.0]
    clock.now = 56.1  # a quick refusal: asked again a second later
    assert side._minting() is None and asks == [0.0, 55.0, 56.1]
