"""The sidecar's open-file budget: its listeners' connection caps must fit under ``ulimit -n``
with room left for everything else, or a flood of the peer port starves the engine socket.

A listener accepts up to its accept backlog in one go and closes connections beyond its cap a
few loop turns later, so each listener may briefly hold ``max_connections`` plus a few backlogs
of descriptors. NIXL, UCX, shared memory, peer clients and logs need the reserve. At start the
soft limit is raised toward the hard one when that is enough; otherwise the sidecar refuses to
start, naming the settings, instead of failing under load.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence

from kvxferd.api.limits import EdgeLimits
from kvxferd.errors import ConfigError

FD_RESERVE = 256
"""Descriptors kept for NIXL/UCX, shared memory, peer HTTP clients, logs and the like."""
ACCEPT_BURSTS = 3
"""Accept batches a listener may hold before the first batch's over-cap closes take effect
(accept, build the transport, close: three loop turns)."""


def fds_needed(listeners: Sequence[EdgeLimits], reserve: int = FD_RESERVE) -> int:
    """Descriptors a process with these listeners may need at worst."""
    return reserve + sum(lim.max_connections + ACCEPT_BURSTS * lim.backlog for lim in listeners)


def ensure_fd_budget(listeners: Sequence[EdgeLimits], reserve: int = FD_RESERVE) -> int:
    """Make the soft open-file limit at least :func:`fds_needed` (raising it up to the hard
    limit); answer the limit now in force. ConfigError when the hard limit is too low."""
    need = fds_needed(listeners, reserve)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        caps = " + ".join(str(lim.max_connections) for lim in listeners)
        raise ConfigError(
            f"connection caps {caps} need {need} open files (with accept bursts and a reserve of "
            f"{reserve}), but the open-file limit is {soft} (hard {hard}): lower "
            "KVXFERD_ENGINE_MAX_CONNECTIONS / KVXFERD_PEER_MAX_CONNECTIONS or raise `ulimit -n`",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need
