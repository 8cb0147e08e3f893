"""The scheduler side of the store (issue 12): which prompts it serves, what is loaded and saved.

The store is a prefix-cache tier behind vLLM's own: it is asked only when nothing of the prompt
is cached locally (a load always starts at token 0, so it never writes shared cached blocks).
A hit is loaded asynchronously like a pull; a finished request's computed tokens are saved by
the workers at the start of the next step, before anything can reuse the freed blocks. Hybrid
models are looked up over ``prompt - 1`` tokens: vLLM recomputes a full hit's last token, which
a Mamba state cannot rewind, so the state must sit exactly where the hit ends (the store's
minimum-prefix rule finds that point).

A key stands for bytes, so everything besides the token ids that decides them is in it: the
engine's model and cache settings (the connector's ``root``) and the request's ``cache_salt``.
Requests whose bytes depend on inputs the tokens do not show (a LoRA adapter, images behind
placeholder tokens, prompt embeddings) are neither looked up nor saved.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import ConfigError, KvxferdError
from kvxferd.store import chunk_keys
from kvxferd.wire import StoreLookup, StoreLookupRequest

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's reserved null block (Mamba groups are mostly null)."""

STORE_MODES = ("off", "load", "save", "both")
STORE_ORDERS = ("remote_first", "store_first")
NAMESPACE_MAX_LENGTH = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Characters a namespace refuses: ASCII and C1 controls, line and paragraph separators."""
_SAVED_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
"""A request that ended normally: its blocks hold its computed tokens (an aborted one may not)."""


@dataclass(frozen=True)
class StoreOptions:
    """The store settings of ``kv_connector_extra_config`` (see README "Use with vLLM")."""

    mode: str = "off"
    """off, load (look up and load), save (save finished requests) or both."""
    order: str = "remote_first"
    """With remote-prefill params: remote_first pulls and ignores the store; store_first skips
    the pull (declining its tickets) when the store holds the whole prompt (minus one token)."""
    chunk_tokens: int = 64
    """Tokens per store chunk: must equal the sidecars' ``store_chunk_tokens``."""
    lookup_timeout_s: float = 2.0
    """Bound of one lookup from the scheduler (a slower or failed lookup is a miss)."""
    namespace: str = ""
    """Names the weights in the keys instead of their files or hub commit (the connector's
    ``store_root``): engines loading one version from different copies share entries."""

    @property
    def load(self) -> bool:
        """Whether prompts are looked up and loaded."""
        return self.mode in ("load", "both")

    @property
    def save(self) -> bool:
        """Whether finished requests are saved."""
        return self.mode in ("save", "both")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> StoreOptions:
        """Read and check the ``store*`` keys (ConfigError naming the key)."""
        mode = str(extra.get("store", "off"))
        if mode not in STORE_MODES:
            raise ConfigError(f"kv_connector_extra_config.store: {mode!r} not one of {STORE_MODES}")
        order = str(extra.get("store_order", "remote_first"))
        if order not in STORE_ORDERS:
            raise ConfigError(
                f"kv_connector_extra_config.store_order: {order!r} not one of {STORE_ORDERS}"
            )
        chunk = _number(extra, "store_chunk_tokens", cls.chunk_tokens, int)
        timeout = _number(extra, "store_lookup_timeout_s", cls.lookup_timeout_s, float)
        namespace = extra.get("store_namespace", "")
        if (
            not isinstance(namespace, str)
            or len(namespace) > NAMESPACE_MAX_LENGTH
            or _CONTROL.search(namespace)
        ):
            raise ConfigError(
                f"kv_connector_extra_config.store_namespace: {namespace!r:.60} is not a string of "
                f"at most {NAMESPACE_MAX_LENGTH} characters without control characters"
            )
        return cls(mode=mode, order=order, chunk_tokens=chunk, lookup_timeout_s=timeout,
                   namespace=namespace)  # fmt: skip


def _number(extra: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """``extra[key]`` as a finite ``kind`` > 0 (an int: whole), else ConfigError naming it."""
    value = extra.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = 0.0
    if isinstance(value, bool) or not 0 < out < math.inf or (kind is int and not out.is_integer()):
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r:.40} is not a finite "
                          f"{'whole ' if kind is int else ''}number > 0")  # fmt: skip
    return kind(out)


@dataclass
class SaveOrder:
    """Every worker saves these blocks' first ``num_tokens`` tokens to its sidecar's store."""

    request_id: str
    keys: list[str]
    block_ids: list[list[int]]
    num_tokens: int


@dataclass
class LoadOrder:
    """Every worker loads the prompt's first ``num_tokens`` tokens into these blocks."""

    request_id: str
    keys: list[str]
    block_ids: list[list[int]]
    num_tokens: int
    error: str = ""
    """Why nothing can be loaded (vLLM took a count the store cannot serve): the workers report
    the blocks as load errors without a call, and vLLM computes them."""


Lookup = Callable[[StoreLookupRequest], StoreLookup]
"""Rank 0's ``/v1/store/lookup`` (bounded; raises KvxferdError)."""


class StorePlanner:
    """Store lookups, load orders and save orders for one engine's scheduler."""

    def __init__(
        self,
        options: StoreOptions,
        lookup: Lookup,
        *,
        root: bytes,
        kinds: list[str] | None,
        block_size: int,
    ) -> None:
        self.options = options
        self.block_size = block_size
        self._lookup = lookup
        self._root = root  # salts the keys: one engine setup's entries never match another's
        self.kinds = kinds or []
        self.hybrid = "mamba" in self.kinds
        self._hits: dict[str, tuple[list[str], int]] = {}  # request id -> (keys, matched)

    def wanted(self, request: Any) -> int:
        """Prompt tokens a hit can cover at most (hybrid: all but the last)."""
        n = len(request.prompt_token_ids)
        return max(0, n - 1) if self.hybrid else n

    def _request_root(self, request: Any) -> bytes | None:
        """The key root of ``request``: the engine's, salted by its ``cache_salt``; None when
        its KV bytes depend on more than its token ids (LoRA, multimodal, prompt embeddings)."""
        if (
            getattr(request, "lora_request", None) is not None
            or getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return None
        salt = getattr(request, "cache_salt", None)
        if salt is None:
            return self._root
        return self._root + b"\0cache_salt\0" + str(salt).encode()

    def match(self, request: Any) -> int:
        """Tokens of the prompt the store serves from its start (0 on a miss or any error)."""
        self._hits.pop(request.request_id, None)
        n = self.wanted(request)
        root = self._request_root(request)
        if not self.options.load or n < 1 or root is None:
            return 0
        keys = chunk_keys(request.prompt_token_ids[:n], self.options.chunk_tokens, root)
        try:
            # rank 0's entries: the lookup asks rank 0's sidecar, or the pod naming rank 0
            hit = self._lookup(StoreLookupRequest(keys=keys, num_tokens=n, tp_rank=0)).matched
        except KvxferdError as exc:  # fail open: the engine computes
            log.warning("store lookup for %.200r failed: %s", request.request_id, exc)
            return 0
        if not 0 < hit <= n:
            return 0
        self._hits[request.request_id] = (keys, hit)
        return hit

    def load(
        self, request: Any, local: Sequence[Sequence[int]], num_external: int
    ) -> LoadOrder | None:
        """The load of a matched request into its allocated blocks (None if nothing matched)."""
        found = self._hits.pop(request.request_id, None)
        if found is None or num_external <= 0:
            return None
        keys, hit = found
        ids = self._ids(local, num_external)
        if num_external != hit:  # vLLM trimmed the hit: the state is not at its end
            return LoadOrder(request.request_id, [], ids, 0, f"{num_external} of {hit} tokens")
        return LoadOrder(request.request_id, keys[: -(-hit // self.options.chunk_tokens)], ids, hit)

    def forget(self, request_id: str) -> None:
        """Drop a matched request's pending hit (it was not allocated after all)."""
        self._hits.pop(request_id, None)

    def save(self, request: Any, block_ids: Sequence[Sequence[int]]) -> SaveOrder | None:
        """The save of a request that ended normally: its computed tokens, all groups."""
        status = getattr(request.status, "name", str(request.status))
        n = int(getattr(request, "num_computed_tokens", 0))
        root = self._request_root(request)
        if not self.options.save or status not in _SAVED_STATUSES or n < 1 or root is None:
            return None
        tokens = list(request.all_token_ids)[:n]
        ids = self._ids(block_ids, n)
        if not any(ids):
            return None
        keys = chunk_keys(tokens, self.options.chunk_tokens, root)
        return SaveOrder(request.request_id, keys, ids, n)

    def _ids(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Per group, the blocks of a store call over ``num_tokens`` tokens: Mamba, its
        running-state block (the last live one); attention, the blocks holding those tokens,
        with vLLM's null block (a sliding window's evicted blocks) as -1: never data."""
        kinds = self.kinds if len(self.kinds) == len(block_ids) else ["attention"] * len(block_ids)
        need = -(-num_tokens // self.block_size)
        return [
            [b for b in g if b != NULL_BLOCK][-1:] if kind == "mamba"
            else [-1 if b == NULL_BLOCK else b for b in g[:need]]
            for kind, g in zip(kinds, block_ids, strict=True)
        ]  # fmt: skip
