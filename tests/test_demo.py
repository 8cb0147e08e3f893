"""The whole P/D flow on loopback: ``kvxferd demo``, and real sims + sidecars + proxy driven with
the ``openai`` client (heterogeneous TP, streaming, a prefill crash and its return)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvxferd.demo import Cluster, ClusterSpec

pytestmark = pytest.mark.nixl

CLIENT_TIMEOUT_S = 60.0
PROMPTS = [
    "the quick brown fox jumps over the lazy dog " * 6,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 5,
    "prefill decode transfer " * 40,
    "short prompt",
]


def test_demo_command_verifies_a_hybrid_by_default() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "demo", "--requests", "8", "--concurrency", "2",
         "--json"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["verified"] is True
    assert summary["requests_ok"] == 8 and summary["requests_failed"] == 0
    assert summary["mismatches"] == 0 and summary["verified_failed"] == 0
    assert summary["kv_bytes"] > 0 and summary["state_bytes"] > 0
    assert summary["config"] == "granite-4.0-h-tiny"
    assert "through the proxy: 8/8 done, 0 failed" in done.stderr


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Dense model (block sizes agree across TP): prefill TP 2 -> decode TP 1, plus colocated."""
    spec = ClusterSpec("qwen3-8b", prefill_tp=2, decode_tp=1, pool_blocks=96,
                       proxy_timeout_s=20.0)  # fmt: skip
    with Cluster(spec) as running:
        yield running


def ask(client: openai.OpenAI, model: str, prompt: str, chat: bool, stream: bool) -> str:
    """One request's full text (chunks joined when streaming)."""
    if chat:
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        if stream:
            chunks = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=12, stream=True)  # fmt: skip
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""
    if stream:
        parts = client.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True)
        return "".join(p.choices[0].text for p in parts if p.choices)
    return client.completions.create(model=model, prompt=prompt, max_tokens=12).choices[0].text


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                         timeout=CLIENT_TIMEOUT_S)  # fmt: skip


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_proxy_answers_equal_colocated_across_tp(
    cluster: Cluster, chat: bool, stream: bool
) -> None:
    assert cluster.colocated is not None
    before = cluster.stats(cluster.decodes[0])
    with client_for(cluster.proxy_url) as proxy, client_for(cluster.colocated.url) as local:
        for prompt in PROMPTS[:2]:
            via_proxy = ask(proxy, cluster.model, prompt, chat, stream)
            reference = ask(local, cluster.model, prompt, chat, stream=False)
            assert via_proxy == reference
            assert len(via_proxy.split()) >= 2
    after = cluster.stats(cluster.decodes[0])
    assert after["verified_failed"] == 0 and after["pulls_failed"] == 0
    assert after["verified_ok"] > before["verified_ok"]
    assert after["kv_bytes"] > before["kv_bytes"]
    assert after["state_bytes"] == 0  # a dense model has no mamba state


def test_models_and_health_through_the_proxy(cluster: Cluster) -> None:
    with client_for(cluster.proxy_url) as proxy:
        assert [m.id for m in proxy.models.list()] == [cluster.model]
    assert httpx.get(cluster.proxy_url + "/health", timeout=30).status_code == 200


def test_prefill_crash_gives_clean_errors_then_recovers(cluster: Cluster) -> None:
    assert cluster.colocated is not None
    prefill_url = cluster.prefills[0].url
    with client_for(cluster.colocated.url) as local:
        reference = {p: ask(local, cluster.model, p, chat=False, stream=False) for p in PROMPTS}
        chat_reference = {p: ask(local, cluster.model, p, chat=True, stream=False) for p in PROMPTS}

    def attempt(prompt: str) -> str | openai.APIStatusError:
        with client_for(cluster.proxy_url) as proxy:
            try:
                return ask(proxy, cluster.model, prompt, chat=False, stream=True)
            except openai.APIStatusError as exc:
                return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        inflight = [pool.submit(attempt, p) for p in PROMPTS * 2]
        cluster.kill_prefill(0)
        results = [f.result(timeout=2 * CLIENT_TIMEOUT_S) for f in inflight]
        after = [f.result(timeout=2 * CLIENT_TIMEOUT_S)
                 for f in [pool.submit(attempt, p) for p in PROMPTS]]  # fmt: skip
    for prompt, got in zip(PROMPTS * 2, results, strict=True):
        if isinstance(got, str):  # finished before the crash: must still be right
            assert got == reference[prompt]
        else:
            assert got.status_code in (502, 503)
    for got in after:
        assert isinstance(got, openai.APIStatusError) and got.status_code == 502
        assert prefill_url in got.message and "unreachable" in got.message

    cluster.restart_prefill(0)
    assert cluster.prefills[0].url == prefill_url
    with client_for(cluster.proxy_url) as proxy:
        for prompt in PROMPTS:
            assert ask(proxy, cluster.model, prompt, chat=False, stream=False) == reference[prompt]
            assert (
                ask(proxy, cluster.model, prompt, chat=True, stream=True) == chat_reference[prompt]
            )
