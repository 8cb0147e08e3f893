"""The NIXL transport: the only package that imports ``nixl``.

:class:`Agent` registers regions, exchanges metadata, posts READs (plain or prepped) and
carries notifications; :class:`Transfer` is one posted READ. The sidecar relies on the seam in
``base`` (Transport, PostedRead); :class:`CompletionPoller` awaits READs on the event loop.
"""

from kvxferd.transport.agent import Agent, SyncMode
from kvxferd.transport.base import PostedRead, Transport
from kvxferd.transport.completion import CompletionPoller
from kvxferd.transport.descs import as_indices, as_xfer_table, check_pairs
from kvxferd.transport.nixl_errors import is_nixl_error, nixl_errors
from kvxferd.transport.prepped import PreppedList
from kvxferd.transport.registration import LiveHandles, Registration
from kvxferd.transport.stripes import StripedAgent, StripedRead
from kvxferd.transport.transfer import Transfer, TransferState

__all__ = [
    "StripedAgent",
    "StripedRead",
    "Agent",
    "CompletionPoller",
    "LiveHandles",
    "PostedRead",
    "PreppedList",
    "Registration",
    "SyncMode",
    "Transfer",
    "TransferState",
    "Transport",
    "as_indices",
    "as_xfer_table",
    "check_pairs",
    "is_nixl_error",
    "nixl_errors",
]
