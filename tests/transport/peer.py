"""A target sidecar in its own process: attaches an engine-owned segment, registers it,
hands its metadata to the test over a pipe and collects notifications until told to stop.

Commands (tuples over the pipe): ("notifs",) -> dict of everything received so far;
("pause", seconds) -> stop progressing/polling NIXL for that long; ("stop",).
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

os.environ.setdefault("UCX_NET_DEVICES", "lo")


def serve(conn: Connection, agent_name: str, shm_name: str, size: int, progress: bool) -> None:
    """Run the target until ("stop",) or the pipe closes."""
    from kvxferd.memory import SharedMemoryRegion
    from kvxferd.transport import Agent

    region = SharedMemoryRegion.attach(shm_name, size)
    agent = Agent(agent_name, progress_thread=progress)
    agent.register(region)
    conn.send(("ready", agent.get_agent_metadata(), region.base_addr))
    received: dict[str, list[bytes]] = {}
    try:
        while True:
            for sender, messages in agent.get_notifs().items():
                received.setdefault(sender, []).extend(messages)
            if not conn.poll(0.002):
                continue
            cmd = conn.recv()
            if cmd[0] == "notifs":
                conn.send(received)
            elif cmd[0] == "pause":
                conn.send("paused")
                time.sleep(cmd[1])
            elif cmd[0] == "stop":
                break
    except (EOFError, OSError):
        pass
    finally:
        agent.close()
        region.close()
