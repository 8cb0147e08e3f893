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
