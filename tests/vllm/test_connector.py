"""KvxferdConnector as vLLM constructs it: parallel layouts whose ranks would share a sidecar
are refused at start, in one message that names the setting."""

from __future__ import annotations

import pytest

from kvxferd.errors import ConfigError
from kvxferd.vllm.connector import KvxferdConnector


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "data_parallel_size_local"])
def test_a_layout_whose_ranks_would_share_a_sidecar_is_refused_at_start(
    engines, monkeypatch, field
):
    """``{rank}`` names the TP rank only: a second pipeline stage or a second local data-parallel
    engine would register over the first's memory on the same socket."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    engine = engines("dense", "LBHNC", num_blocks=24)
    monkeypatch.setattr(engine.config.parallel_config, field, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=rf"^{field}=2 is not supported: \{{rank\}} in "):
            KvxferdConnector(engine.config, role, engine.kv_cache_config)


def _decode_scheduler(engine, ident):
    """vLLM's own Scheduler for the decode engine, its connector knowing prefill ``ident``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    sched = Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )
    sched.connector._sched._known = [ident]
    return sched


def _worker_step(sched, engine):
    """One step the way vLLM's model runner takes it: its own connector wrapper
    (``kv_connector_no_forward``) collects the worker connector's transfer results, and every
    scheduled request samples token 7 (no model runs here)."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    out = sched.schedule()
    kv = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, engine.config)
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kv.kv_connector_output,
    )
    sched.update_from_output(out, result)
    return out.num_scheduled_tokens


@pytest.mark.nixl
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_of_a_hybrid_model_fails_one_request_not_the_engine(
    engines, monkeypatch, tmp_path, policy
):
    """Block ids are per KV-cache group in a hybrid model, so vLLM refuses block-level load
    errors for it (an exception in its scheduler ends every request): a failed pull is reported
    by request, and vLLM fails (or recomputes) that request alone."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.request import RequestStatus

    from tests.sidecar.harness import TOKEN, wait_until
    from tests.vllm.ranks import finish, prefill_side, request, worker_pair

    engine = engines("nemotron-h", "LBHNC", num_blocks=24)
    monkeypatch.setattr(engine.config.kv_transfer_config, "kv_load_failure_policy", policy)
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    bs = engine.config.cache_config.block_size
    with worker_pair(tmp_path, "LBHNC", engine) as (_prefill, decode, p_side):
        with p_side.client() as c:
            ident = c.identity()
        minting = prefill_side(lambda: [ident], bs, partial_prefill=True)
        ids = [[1, 2, 3] for _ in engine.kv_cache_config.kv_cache_groups]
        _delay, params = finish(minting, "r1", ids, 300)
        minting.take_orders()  # the prefill never places the hold: the claim finds none
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", decode.connector)
        sched = _decode_scheduler(engine, ident)
        sched.add_request(request("d", 300, dict(params), bs, prompt=list(range(300))))
        assert _worker_step(sched, engine) == {}  # the pull starts
        assert sched.requests["d"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        scheduled: dict[str, int] = {}

        def settled():
            scheduled.update(_worker_step(sched, engine))
            return "d" in scheduled or "d" not in sched.requests

        wait_until(settled, 60, "the failed pull to reach vLLM")
        if policy == "fail":
            assert "d" not in sched.requests and scheduled == {}  # it ended with an error
        else:
            assert scheduled == {"d": 300}  # computed here, from its first token
        sched.add_request(request("next", 40, None, bs))
        assert _worker_step(sched, engine).get("next") == 40  # the engine serves on


@pytest.mark.parametrize("value", ["false", "true", 0, None])
def test_a_partial_prefill_setting_that_is_not_true_or_false_is_refused_naming_it(
    engines, monkeypatch, value
):
    """``"false"`` was read as on (any non-empty string is): the prefill dropped the last
    token of every prompt a remote decode takes over, as if it were a Mamba hybrid's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    engine = engines("dense", "LBHNC", num_blocks=24)
    extra = engine.config.kv_transfer_config.kv_connector_extra_config
    monkeypatch.setitem(extra, "partial_prefill", value)
    with pytest.raises(ConfigError, match="^partial_prefill: expected true or false, got "):
        KvxferdConnector(engine.config, KVConnectorRole.SCHEDULER, engine.kv_cache_config)
    monkeypatch.setitem(extra, "partial_prefill", False)
    connector = KvxferdConnector(engine.config, KVConnectorRole.SCHEDULER, engine.kv_cache_config)
    assert connector._sched.partial_prefill is False
