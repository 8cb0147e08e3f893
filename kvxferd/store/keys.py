"""Store keys: chained hashes of token-prefix chunks, like a prefix cache's block hashes.

Chunk ``c`` of a prompt covers tokens ``[c*C, min((c+1)*C, n))`` (``C`` = the store's chunk size,
vLLM's ``hybrid_chunk_size``); its key hashes the previous key and the chunk's token ids, so a
key names a whole prefix, never a chunk alone. The last chunk may be partial (it carries the
Mamba state at the prompt's end).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from kvxferd.errors import StoreError
from kvxferd.wire import STORE_KEY_HEX, STORE_KEY_PATTERN

_KEY_RE = re.compile(STORE_KEY_PATTERN)


def chunk_keys(tokens: Sequence[int], chunk_tokens: int, root: bytes = b"") -> list[str]:
    """The key of every chunk of ``tokens`` (``root`` salts the chain, e.g. a model or seed)."""
    if chunk_tokens < 1:
        raise StoreError("chunk_tokens", f"{chunk_tokens} < 1")
    ids = np.asarray(tokens, dtype="<u4")
    prev = hashlib.blake2b(root, digest_size=STORE_KEY_HEX // 2).digest()
    keys = []
    for start in range(0, ids.size, chunk_tokens):
        h = hashlib.blake2b(prev, digest_size=STORE_KEY_HEX // 2)
        h.update(ids[start : start + chunk_tokens].tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def chunk_spans(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` token span of every chunk of a ``num_tokens`` prompt."""
    return [(s, min(s + chunk_tokens, num_tokens)) for s in range(0, num_tokens, chunk_tokens)]


def window_first_chunk(spans: Sequence[tuple[int, int]], n: int, window: int) -> int:
    """The first chunk a sliding-window group needs to serve a prefix of the first ``n`` chunks:
    the one holding token ``end - window`` (the window before the next token), 0 if none."""
    if n == 0:
        return 0
    start = max(0, spans[n - 1][1] - window)
    return next(i for i, (_s, e) in enumerate(spans) if e > start)


def check_keys(keys: Sequence[str], num_tokens: int, chunk_tokens: int) -> None:
    """Keys must be well-formed, exactly one per chunk of ``num_tokens`` and all different
    (StoreError naming the entry): a key names its whole prefix, so a repeat is never a prompt's
    (saved, it would file one chunk's entry under another chunk's key)."""
    want = -(-num_tokens // chunk_tokens) if num_tokens > 0 else 0
    if num_tokens < 0:
        raise StoreError("num_tokens", f"{num_tokens} < 0")
    if len(keys) != want:
        raise StoreError(
            "keys", f"{len(keys)} keys, {num_tokens} tokens in chunks of {chunk_tokens} need {want}"
        )
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise StoreError(f"keys[{i}]", f"not {STORE_KEY_HEX} lowercase hex digits")
        if first.setdefault(key, i) != i:
            raise StoreError(f"keys[{i}]", f"repeats keys[{first[key]}]")
