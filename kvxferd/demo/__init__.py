"""``kvxferd demo``: prefill and decode sims with real sidecars, the proxy, and a colocated
reference on loopback; requests through the proxy with the ``openai`` client, verified.
"""

from kvxferd.demo.cluster import Cluster, ClusterSpec, Sim
from kvxferd.demo.run import DEFAULT_CONFIG, DemoOptions, run_demo
from kvxferd.demo.summary import Summary, render

__all__ = ["DEFAULT_CONFIG", "Cluster", "ClusterSpec", "DemoOptions", "Sim", "Summary", "render",
           "run_demo"]  # fmt: skip
