"""Find and read Hugging Face configs: a bundled preset by name, or a ``config.json`` path.

This is the layout package's only I/O.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvxferd.errors import ConfigError

CONFIG_DIR = Path(__file__).with_name("configs")
"""Where the bundled, trimmed configs live (one ``<preset>.json`` each)."""


def preset_names() -> list[str]:
    """Names accepted by :func:`load_hf_config` without a path, sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_hf_config(path_or_preset: str | Path) -> dict[str, Any]:
    """The config dict of a bundled preset (``"granite-4.0-h-tiny"``) or of a JSON file.

    A directory is read as ``<dir>/config.json``. Raises :class:`ConfigError` naming the input.
    """
    text = str(path_or_preset)
    preset = CONFIG_DIR / f"{text}.json"
    if "/" not in text and preset.is_file():
        path = preset
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"config {text!r}: no such file and no bundled preset "
            f"(presets: {', '.join(preset_names())})"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config {text!r}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {text!r}: top level is {type(data).__name__}, not an object")
    return data
