"""The worker side of the store: one rank's saves and loads through its own sidecar (or the
pod sidecar every rank shares, each call naming the rank).

Both calls are synchronous and bounded: a load by its ``deadline_s`` in the sidecar, which
answers only once nothing more is written (so a load that fails by its deadline never writes into
blocks vLLM then computes), the client waiting a margin longer. Saves run first in a
step, before anything can write the blocks of a request that has just finished (vLLM frees them
at once: no delayed free). A load is reported finished in the same step's ``get_finished``; a
load that fails (store_miss, store_corrupt, sidecar error) reports its blocks as load errors and
vLLM computes them. Each rank's sidecar keeps its own share of the heads, so every rank saves and
loads the same orders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvxferd.client import EngineClient
from kvxferd.errors import KvxferdError
from kvxferd.vllm.storeplan import LoadOrder, SaveOrder
from kvxferd.wire import StoreLoadRequest, StoreSaveRequest

log = logging.getLogger(__name__)


class StoreCalls:
    """One rank's store calls and what they leave for ``get_finished`` and the load errors."""

    def __init__(self, client: EngineClient, generation: Callable[[], int], tp_rank: int = -1
                 ) -> None:  # fmt: skip
        self.client = client
        self._generation = generation  # the rank's registration: the sidecar checks it
        self._tp_rank = tp_rank  # named on a pod sidecar (its blocks); -1: the rank's own
        self._done: set[str] = set()  # loads ended (done or failed) since the last take
        self._errors: set[int] = set()  # blocks of failed loads
        self._failed: set[str] = set()  # requests of failed loads

    def save(self, orders: list[SaveOrder]) -> None:
        """Save each finished request's blocks (a failure is logged: nothing else depends on it)."""
        for o in orders:
            req = StoreSaveRequest(request_id=o.request_id, keys=o.keys, block_ids=o.block_ids,
                                   num_tokens=o.num_tokens, generation=self._generation(),
                                   tp_rank=self._tp_rank)  # fmt: skip
            try:
                self.client.store_save(req)
            except KvxferdError as exc:
                log.warning("store save of %.200r failed: %s", o.request_id, exc)

    def load(self, orders: list[LoadOrder]) -> None:
        """Load each matched prompt into its blocks; a failure makes them load errors."""
        for o in orders:
            self._done.add(o.request_id)
            reason = o.error
            if not reason:
                req = StoreLoadRequest(
                    keys=o.keys,
                    block_ids=o.block_ids,
                    num_tokens=o.num_tokens,
                    request_id=o.request_id,
                    generation=self._generation(),
                    tp_rank=self._tp_rank,
                )
                try:
                    status = self.client.store_load(req)
                except KvxferdError as exc:
                    reason = str(exc)
                else:
                    if status.state != "done":
                        reason = f"{status.reason}: {status.detail}"
            if reason:
                log.warning(
                    "store load of %.200r failed (vLLM computes it): %s", o.request_id, reason
                )
                self._errors.update(b for g in o.block_ids for b in g if b >= 0)
                self._failed.add(o.request_id)

    def take_done(self) -> set[str]:
        """Requests whose load ended since the last call."""
        out, self._done = self._done, set()
        return out

    def take_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call."""
        out, self._errors = self._errors, set()
        return out

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call."""
        out, self._failed = self._failed, set()
        return out
