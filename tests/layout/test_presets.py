"""load_hf_config: bundled presets by bare name, files by path, clear errors otherwise."""

from __future__ import annotations

import json

import pytest

from kvxferd.errors import ConfigError
from kvxferd.layout import load_hf_config, preset_names

EXPECTED = {
    "granite-4.0-h-tiny",
    "qwen3.5-397b-a17b",
    "nemotron-h-8b",
    "qwen3-next-80b-a3b",
    "jamba-mini-1.5",
    "falcon-h1-0.5b",
    "llama-3.1-8b",
    "qwen3-8b",
    "gpt-oss-20b",
}


def test_all_presets_are_bundled_with_model_type_and_architectures():
    assert set(preset_names()) == EXPECTED
    for name in EXPECTED:
        cfg = load_hf_config(name)
        assert cfg["model_type"] and cfg["architectures"]


def test_path_and_directory_are_read(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(tmp_path / "config.json") == cfg
    assert load_hf_config(str(tmp_path)) == cfg


def test_unknown_name_lists_presets():
    with pytest.raises(ConfigError, match="granite-4.0-h-tiny"):
        load_hf_config("no-such-model")


def test_bad_json_is_a_config_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read JSON"):
        load_hf_config(path)
