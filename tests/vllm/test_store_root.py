"""The store keys' root names the weights an engine loaded, not only their path and config: a
model redeployed to the same path or a hub model whose ``main`` moved must miss the entries
the old weights computed (files under ``--store-dir`` outlive the engine). ``store_namespace``
names the weights instead, for engines that load the same weights from different copies."""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvxferd.errors import ConfigError
from kvxferd.vllm.connector import store_root
from kvxferd.vllm.storeplan import StoreOptions

SHARD = "model-00001-of-00001.safetensors"


def _weights_part(root: bytes) -> str:
    """The ``weights`` part of a root (``kvxferd-store/1\\0`` and the parts as JSON)."""
    return json.loads(root.split(b"\0", 1)[1])["weights"]


def _model_dir(tmp_path, name: str = "model"):
    """A local model directory: one shard, its index, a config and a README (not weights)."""
    path = tmp_path / name
    path.mkdir()
    (path / SHARD).write_bytes(b"old weights")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (path / "config.json").write_text("{}")
    (path / "README.md").write_text("a model")
    return path


def _redeploy(path, content: bytes = b"new weights") -> None:
    """Rewrite the shard in place with same-size bytes, under a later mtime (set explicitly:
    two writes within one clock tick may share one)."""
    shard = path / SHARD
    old = shard.stat().st_mtime_ns
    shard.write_bytes(content)
    os.utime(shard, ns=(old + 1_000_000_000, old + 1_000_000_000))


@pytest.fixture
def config(engines, monkeypatch):
    """The dense engine's real VllmConfig; tests repoint its model (undone after each)."""
    config = engines("dense", num_blocks=32).config
    monkeypatch.setattr(config.model_config, "revision", None)
    return config


def _extra(monkeypatch, config, **keys) -> None:
    cfg = config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config",
                        {**(cfg.kv_connector_extra_config or {}), **keys})  # fmt: skip


def test_a_local_model_redeployed_to_the_same_path_gets_a_new_root(config, monkeypatch, tmp_path):
    """The weight files' names, sizes and mtimes are in the root: the same files give the same
    root every time (another process finds its entries); a rewritten shard (same size, new
    mtime) gives another one. Files that are not weights do not count."""
    path = _model_dir(tmp_path)
    monkeypatch.setattr(config.model_config, "model", str(path))
    before = store_root(config)
    assert store_root(config) == before
    assert _weights_part(before) != ""

    (path / "README.md").write_text("a longer description of the model")
    assert store_root(config) == before

    _redeploy(path)
    after = store_root(config)
    assert after != before
    assert store_root(config) == after


def test_a_new_shard_or_index_changes_a_local_models_root(config, monkeypatch, tmp_path):
    """Every weight format and the index count: a shard added next to the old ones or a
    rewritten index is another set of weights."""
    path = _model_dir(tmp_path)
    monkeypatch.setattr(config.model_config, "model", str(path))
    roots = {store_root(config)}
    for name in ("extra.bin", "adapter.pt", "lm_head.pth", "q4.gguf"):
        (path / name).write_bytes(b"w")
        roots.add(store_root(config))
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "b"}}')
    roots.add(store_root(config))
    assert len(roots) == 6


def _hub_cache(root, repo: str, commit: str) -> None:
    """A Hugging Face hub cache holding ``repo``'s config.json at ``commit``, with ``main``
    pointing there (the layout huggingface_hub writes)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub reads: it takes HF_HUB_CACHE from the
    environment at import, so its module constant is what a test must point."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_models_root_names_the_cached_snapshot_commit(config, monkeypatch, hub_cache):
    """A hub id names the commit of the snapshot vLLM loaded: ``main`` moving to another
    commit (revision unset) gives another root; the same snapshot the same root."""
    c1, c2 = "1" * 40, "2" * 40
    monkeypatch.setattr(config.model_config, "model", "org/name")
    _hub_cache(hub_cache, "org/name", c1)
    first = store_root(config)
    assert _weights_part(first) == f"hub:{c1}"
    assert store_root(config) == first

    _hub_cache(hub_cache, "org/name", c2)
    assert _weights_part(store_root(config)) == f"hub:{c2}"
    assert store_root(config) != first

    monkeypatch.setattr(config.model_config, "revision", c1)  # a pinned commit
    assert _weights_part(store_root(config)) == f"hub:{c1}"


def test_weights_that_cannot_be_named_leave_the_part_empty(config, monkeypatch, hub_cache, caplog):
    """A model the cache does not hold, a config.json the cache records as missing, or a
    model name that is neither a directory nor a hub id: the part is empty and the engine
    starts (never an exception on vLLM's start path), logged once per model at INFO."""
    commit = "3" * 40
    repo_dir = hub_cache / "models--org--gone"
    (repo_dir / ".no_exist" / commit).mkdir(parents=True)
    (repo_dir / ".no_exist" / commit / "config.json").write_text("")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    models = ("org/absent", "org/gone", "/no/such/model/dir", "not a repo id!")
    caplog.set_level(logging.INFO, logger="kvxferd.vllm.weights")
    for model in models * 2:
        monkeypatch.setattr(config.model_config, "model", model)
        assert _weights_part(store_root(config)) == "", model
    logged = [r for r in caplog.records if r.name == "kvxferd.vllm.weights"]
    assert [r.levelno for r in logged] == [logging.INFO] * len(models)
    assert all(m in r.getMessage() for m, r in zip(models, logged, strict=True))


def test_store_namespace_names_the_weights_instead(config, monkeypatch, tmp_path):
    """With ``store_namespace`` set the weight files' mtimes no longer count (two copies of
    the same weights share entries); two namespaces never share entries."""
    path = _model_dir(tmp_path)
    monkeypatch.setattr(config.model_config, "model", str(path))
    _extra(monkeypatch, config, store_namespace="ft-2026-11")
    first = store_root(config)
    _redeploy(path, b"old weights")
    assert store_root(config) == first

    _extra(monkeypatch, config, store_namespace="ft-2026-12")
    assert store_root(config) != first


@pytest.mark.parametrize("value", [7, ["a"], "x" * 257, "ft\n2026", "ft\x1b[2J", "ft\x85"])
def test_a_bad_store_namespace_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="kv_connector_extra_config.store_namespace:"):
        StoreOptions.from_extra({"store": "both", "store_namespace": value})


def test_store_namespace_defaults_to_empty_and_takes_256_characters():
    assert StoreOptions.from_extra({}).namespace == ""
    assert StoreOptions.from_extra({"store_namespace": "n" * 256}).namespace == "n" * 256


def test_a_hub_model_under_download_dir_is_named_from_there(
    config, monkeypatch, hub_cache, tmp_path
):
    """vLLM's ``--download-dir`` is where it put the weights: its snapshot's commit names
    them, before the default cache's."""
    download = tmp_path / "download"
    _hub_cache(download, "org/name", "4" * 40)
    _hub_cache(hub_cache, "org/name", "5" * 40)
    monkeypatch.setattr(config.model_config, "model", "org/name")
    monkeypatch.setattr(config.load_config, "download_dir", str(download))
    assert _weights_part(store_root(config)) == "hub:" + "4" * 40
