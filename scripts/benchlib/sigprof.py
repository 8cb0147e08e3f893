"""Run ``python -m kvxferd ARGS`` with cProfile windows opened and closed by signals.

    python scripts/benchlib/sigprof.py OUT_PREFIX serve --engine-socket ...

SIGUSR1 starts a fresh profile of the main thread (the sidecar's event loop); SIGUSR2 stops it
and writes ``OUT_PREFIX.N.prof`` (N = 0, 1, ... per window), so a benchmark profiles only the
phase it measures, not start-up. Threads (post executor, ``to_thread`` hops) are not profiled.
The profile's clock is the main thread's CPU time (``time.thread_time``), not wall time: with
nine sidecars on two vCPUs a wall clock charges a function for the time other processes ran
(a loopback ``send`` looked like 0.4 ms). Garbage collections of the window are timed too
(cProfile charges them to whichever function allocated): ``OUT_PREFIX.N.gc.json``, seconds and
count per generation.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import runpy
import signal
import sys
import time


def main() -> None:
    prefix = sys.argv[1]
    state: dict = {"prof": None, "n": 0, "gc": None, "t0": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        if state["gc"] is None:
            return
        if phase == "start":
            state["t0"] = time.perf_counter()
        else:
            slot = state["gc"].setdefault(str(info["generation"]), [0.0, 0])
            slot[0] += time.perf_counter() - state["t0"]
            slot[1] += 1

    def start(*_: object) -> None:
        state["gc"] = {}
        state["prof"] = cProfile.Profile(time.thread_time)
        state["prof"].enable()

    def stop(*_: object) -> None:
        prof, state["prof"] = state["prof"], None
        if prof is None:
            return
        prof.disable()
        collections, state["gc"] = state["gc"], None
        with open(f"{prefix}.{state['n']}.gc.json", "w") as fh:
            json.dump(collections, fh)
        path = f"{prefix}.{state['n']}.prof"
        prof.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)  # the benchmark waits for the final name
        state["n"] += 1

    gc.callbacks.append(on_gc)
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["kvxferd", *sys.argv[2:]]
    sys.path.insert(0, os.getcwd())  # as ``python -m`` would
    runpy.run_module("kvxferd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
