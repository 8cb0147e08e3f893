"""What names the weights an engine loaded, for the store keys' root: files under
``--store-dir`` outlive the engine, so weights redeployed under the same model path and config
must miss the entries the old ones computed (a miss costs a recompute, a wrong hit wrong text).

A local model directory is named by its weight files' names, sizes and mtimes (stat only: a
redeploy rewrites them; the bytes are GBs); a hub id by the commit of its snapshot in the local
Hugging Face cache. Weights that cannot be named give ``""`` (logged once): never an exception
on vLLM's start path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json")
"""Top-level files of a model directory that are weights or say which files are."""

_unnamed: set[str] = set()
"""Models already logged as unnamed (one line per model and process)."""


def fingerprint(model_config: Any, download_dir: str | None = None) -> str:
    """``local:<digest>`` of a local directory's weight files, ``hub:<commit>`` of a hub id's
    cached snapshot (looked up in ``download_dir``, vLLM's ``--download-dir``, then in the
    default cache), ``""`` when neither can be read."""
    model = str(model_config.model)
    try:
        if os.path.isdir(model):
            return "local:" + _local(model)
        for cache_dir in dict.fromkeys([download_dir or None, None]):
            if commit := _hub_commit(model, model_config.revision, cache_dir):
                return "hub:" + commit
        why = "not in the local Hugging Face cache"
    except Exception as exc:  # noqa: BLE001 -- vLLM must start; an unnamed part only shares
        why = f"{type(exc).__name__}: {exc}"
    if model not in _unnamed:
        _unnamed.add(model)
        log.info("store keys cannot name the weights of %s (%s); set store_namespace to name "
                 "them", model, why)  # fmt: skip
    return ""


def _local(path: str) -> str:
    """A digest of the sorted (name, size, st_mtime_ns) of ``path``'s top-level weight files;
    stat follows links (a directory of links into a hub cache names the files they reach)."""
    files = []
    with os.scandir(path) as entries:
        for entry in entries:
            if any(fnmatch.fnmatch(entry.name, p) for p in WEIGHT_FILES) and entry.is_file():
                st = entry.stat()
                files.append((entry.name, st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()


def _hub_commit(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    """The commit of the cached snapshot holding ``repo_id``'s config.json at ``revision``
    (None: main), read from the local cache only; ``""`` when the cache does not hold it."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        repo_id=repo_id, filename="config.json", revision=revision, cache_dir=cache_dir
    )
    if not isinstance(found, str):  # None (not cached) or _CACHED_NO_EXIST (cached as absent)
        return ""
    snapshot = os.path.dirname(found)  # .../snapshots/<commit>/config.json
    if os.path.basename(os.path.dirname(snapshot)) != "snapshots":
        return ""
    return os.path.basename(snapshot)
