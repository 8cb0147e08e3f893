"""``kvxferd proxy`` as an operator runs it: ready line, health of its backends, clean stop."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import httpx

from tests.proxy.fakes import FakeBackend, fake_app, free_port, serve_app

READY_TIMEOUT_S = 60.0


def test_proxy_command_prints_ready_serves_and_stops_on_sigint() -> None:
    decode = serve_app(fake_app(FakeBackend("D0", "decode")))
    dead = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", dead, "--decode", decode.url,
         "--port", "0", "--timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)  # type: ignore[union-attr]
    pump.start()
    try:
        line = lines.get(timeout=READY_TIMEOUT_S)
        assert line.startswith("kvxferd proxy ready url=http://127.0.0.1:"), line
        url = line.split("url=", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=30) as c:
            health = c.get("/health")
            failed = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert health.status_code == 503 and health.json()["down"] == [dead]
        assert failed.status_code == 502 and dead in failed.json()["error"]["message"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        pump.join(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
        decode.stop()


def test_bad_backend_url_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", "localhost:8100",
         "--decode", "http://127.0.0.1:1", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--prefill: 'localhost:8100' is not an http(s) URL" in done.stderr
