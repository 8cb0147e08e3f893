"""``kvxferd sim`` end to end: real sim processes, their sidecars, NIXL over loopback.

Prefill and decode sims answer like OpenAI servers; the decode's text equals the colocated
sim's for the same prompt because it is a function of the KV bytes the decode received and
verified. One set of sims (module scope) serves every test; tests that hold prefill blocks wait
until they are back, so the tests do not depend on each other, except the last two, which
kill or stop sims (they run last, in file order).
"""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from tests.sidecar.harness import wait_until
from tests.sim.procs import PATHS, STUB, Sim, running_sims, text_of

pytestmark = pytest.mark.nixl

MODEL = "granite-4.0-h-tiny"  # 9 mamba groups + 1 attention group of 400-token blocks
POOL = ["--config", MODEL, "--pool-blocks", "30"]
SHORT = "The quick brown fox jumps over the lazy dog, twice."
LONG = " ".join(f"w{i}" for i in range(1000))  # 1001 tokens: 2 full attention blocks + 1 part
ATTN_BLOCK = 400
TP2_LEASE_S = 5  # short, so an unpulled hold expires soon; long enough for a loaded machine


@pytest.fixture(scope="module")
def sims():
    with running_sims({
        "prefill": ["--role", "prefill", *POOL],
        "decode": ["--role", "decode", "--on-pull-failure", "fail", *POOL],
        "colocated": ["--role", "colocated", *POOL],
        "prefill_tp2": ["--role", "prefill", "--tp", "2", "--lease", str(TP2_LEASE_S), *POOL],
        "decode_recompute": ["--role", "decode", "--on-pull-failure", "recompute", *POOL],
    }) as procs:  # fmt: skip
        yield procs


def _body(kind: str, prompt: str, **extra: object) -> dict[str, object]:
    if kind == "completion":
        return {"prompt": prompt, **extra}
    return {"messages": [{"role": "user", "content": prompt}], **extra}


def _prefill(p: Sim, kind: str, prompt: str) -> dict:
    resp = p.post(PATHS[kind], _body(kind, prompt, max_tokens=1, kv_transfer_params=STUB))
    assert resp.status_code == 200, resp.text
    assert len(text_of(kind, resp).split()) == 1
    return resp.json()["kv_transfer_params"]


def _decode(d: Sim, kind: str, prompt: str, params: dict, stream: bool = False) -> str:
    body = _body(kind, prompt, max_tokens=12, stream=stream, kv_transfer_params=params)
    return text_of(kind, d.post(PATHS[kind], body))


def _colocated(c: Sim, kind: str, prompt: str) -> str:
    return text_of(kind, c.post(PATHS[kind], _body(kind, prompt, max_tokens=12)))


def _all_free(sim: Sim) -> bool:
    s = sim.stats()
    return s["blocks_free"] == s["blocks_total"] and s["holds_outstanding"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_decode_text_equals_colocated_and_prefill_blocks_come_back(sims, kind, stream):
    p, d, c = sims["prefill"], sims["decode"], sims["colocated"]
    before_p, before_d = p.stats(), d.stats()
    params = _prefill(p, kind, SHORT)
    assert params["do_remote_prefill"] is True and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == 10 and len(params["kvxferd_tickets"]) == 1
    assert p.stats()["blocks_free"] == before_p["blocks_free"] - 10  # held for the decode
    text = _decode(d, kind, SHORT, params, stream=stream)
    assert len(text.split()) == 12
    assert text == _colocated(c, kind, SHORT)
    after = d.stats()
    assert after["verified_ok"] == before_d["verified_ok"] + 1
    assert after["verified_failed"] == 0
    assert after["kv_bytes"] > before_d["kv_bytes"] and after["state_bytes"] > 0
    wait_until(lambda: _all_free(p), what="prefill blocks back on the free list")
    assert p.stats()["holds_released"] == before_p["holds_released"] + 1


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_prompt_with_lone_surrogates_is_pulled_and_answered_like_colocated(sims, kind):
    """JSON may escape a lone surrogate ("\\ud800"), which UTF-8 cannot carry; vLLM serves such
    a prompt. Prefill and decode tokenize it alike: the decode pulls with the prefill's tickets
    and answers what the colocated sim does (once a 500)."""
    p, d, c = sims["prefill"], sims["decode"], sims["colocated"]
    prompt = "Half a pair: \ud800, the other half alone: \udc00!"
    before = d.stats()
    text = _decode(d, kind, prompt, _prefill(p, kind, prompt))
    assert d.stats()["verified_ok"] == before["verified_ok"] + 1
    assert text == _colocated(c, kind, prompt)
    assert text != _colocated(c, kind, prompt.replace("\ud800", "?"))
    wait_until(lambda: _all_free(p), what="prefill blocks back on the free list")


def test_a_different_prompt_gives_different_text(sims):
    c = sims["colocated"]
    assert _colocated(c, "completion", SHORT) != _colocated(c, "completion", SHORT + " Again.")


def test_repeated_prompt_pulls_only_the_blocks_the_prefix_cache_lacks(sims):
    p, d, c = sims["prefill"], sims["decode"], sims["colocated"]
    texts, pulled, kv = [], [], []
    for _ in range(2):
        before = d.stats()
        texts.append(_decode(d, "completion", LONG, _prefill(p, "completion", LONG)))
        after = d.stats()
        pulled.append(after["blocks_pulled"] - before["blocks_pulled"])
        kv.append(after["kv_bytes"] - before["kv_bytes"])
    full = 1001 // ATTN_BLOCK
    assert pulled == [9 + 3, 9 + 3 - full]  # mamba states and the partial block always move
    assert 0 < kv[1] < kv[0]
    assert d.stats()["prefix_hits"] >= full
    assert texts[0] == texts[1] == _colocated(c, "completion", LONG)
    wait_until(lambda: _all_free(p), what="prefill blocks back on the free list")


def test_heterogeneous_tp_prefill_2_decode_1(sims):
    p2, d, c = sims["prefill_tp2"], sims["decode"], sims["colocated"]
    before = d.stats()
    params = _prefill(p2, "chat", SHORT)
    assert params["tp_size"] == 2
    assert [t["tp_rank"] for t in params["kvxferd_tickets"]] == [0, 1]
    assert _decode(d, "chat", SHORT, params) == _colocated(c, "chat", SHORT)
    assert d.stats()["verified_ok"] == before["verified_ok"] + 1
    wait_until(lambda: _all_free(p2), what="both prefill ranks to release the hold")


def test_a_hold_nobody_pulls_expires_and_its_blocks_return(sims):
    p = sims["prefill_tp2"]
    before = p.stats()
    _prefill(p, "completion", SHORT)
    assert p.stats()["blocks_free"] == before["blocks_free"] - 10
    wait_until(lambda: _all_free(p), timeout_s=TP2_LEASE_S + 30, what="the lease to expire")
    after = p.stats()
    assert after["holds_expired"] == before["holds_expired"] + 1
    assert after["holds_released"] == before["holds_released"] + 1


def test_pool_exhaustion_is_a_503_and_pulls_free_the_pool(sims):
    p, d = sims["prefill"], sims["decode"]
    held = [_prefill(p, "completion", f"{SHORT} {i}") for i in range(2)]  # 20 of 29 blocks
    resp = p.post(PATHS["completion"], _body("completion", SHORT, max_tokens=1,
                                             kv_transfer_params=STUB))  # fmt: skip
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert "KV pool exhausted: 10 blocks needed, 9 of 29 free" in error["message"]
    assert error["code"] == 503
    for i, params in enumerate(held):
        _decode(d, "completion", f"{SHORT} {i}", params)
    wait_until(lambda: _all_free(p), what="prefill blocks back after the pulls")


def test_a_prompt_larger_than_the_pool_is_a_400(sims):
    resp = sims["colocated"].post(PATHS["completion"], {"prompt": "x " * 12000})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt"
    assert "--pool-blocks" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, "body"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "a", "model": "nope"}', 404, "model"),
        ("/v1/completions",
         b'{"prompt": "a", "kv_transfer_params": {"do_remote_prefill": true}}', 400,
         "kv_transfer_params.kvxferd_tickets"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors_naming_the_field(sims, path, body, status, param):
    d = sims["decode"]
    before = d.stats()
    resp = d.post(path, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    after = d.stats()
    assert after["requests_failed"] == before["requests_failed"] + 1
    assert after["blocks_free"] == before["blocks_free"]


def test_tickets_for_another_prompt_are_refused(sims):
    p, d = sims["prefill"], sims["decode"]
    params = _prefill(p, "completion", SHORT)
    resp = d.post(PATHS["completion"], _body("completion", LONG, kv_transfer_params=params))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"
    # The refused request's tickets are declined: the prefill frees its blocks now, not at
    # lease expiry; a fresh prefill of the right prompt then pulls (and releases) as usual.
    wait_until(lambda: _all_free(p), what="prefill blocks back after the decline")
    _decode(d, "completion", SHORT, _prefill(p, "completion", SHORT))
    wait_until(lambda: _all_free(p), what="prefill blocks back")


def test_models_health_and_request_id(sims):
    d = sims["decode"]
    models = d.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["ibm-granite/granite-4.0-h-tiny"]
    assert d.get("/health").json() == {"status": "ok", "role": "decode"}
    resp = d.post(PATHS["completion"], {"prompt": "hi", "max_tokens": 2},
                  headers={"X-Request-Id": "abc-123"})  # fmt: skip
    assert resp.headers["x-request-id"] == "abc-123"
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert d.stats()["local"] >= 1


def test_a_client_request_id_too_long_for_a_hold_is_a_400_naming_the_header(sims):
    p = sims["prefill"]
    before = p.stats()
    body = _body("completion", SHORT, max_tokens=1, kv_transfer_params=STUB)
    resp = p.post(PATHS["completion"], body, headers={"X-Request-Id": "x" * 504})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "X-Request-Id"
    assert p.stats()["requests_failed"] == before["requests_failed"] + 1
    longest = p.post(PATHS["completion"], body, headers={"X-Request-Id": "x" * 503})
    assert longest.status_code == 200, longest.text
    params = longest.json()["kv_transfer_params"]
    assert len(params["remote_request_id"]) == 512  # the client's id, "-" and 8 hex digits
    assert _decode(sims["decode"], "completion", SHORT, params) == _colocated(
        sims["colocated"], "completion", SHORT)  # fmt: skip
    wait_until(lambda: _all_free(p), what="prefill blocks back after the pull")


def _refuses(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return True
    return False


def test_killed_prefill_fail_policy_502_recompute_policy_matches_colocated(sims):
    p = sims["prefill_tp2"]
    d_fail, d_re, c = sims["decode"], sims["decode_recompute"], sims["colocated"]
    _decode(d_re, "completion", LONG, _prefill(p, "completion", LONG))  # primes its prefix cache
    params = _prefill(p, "completion", LONG)
    p.child.kill()  # SIGKILL after answering; its sidecars die with it
    for t in params["kvxferd_tickets"]:
        host, port = t["peer"].rsplit(":", 1)
        wait_until(lambda: _refuses(host, int(port)), what="the prefill sidecars to be gone")  # noqa: B023
    before = d_fail.stats()
    resp = d_fail.post(PATHS["completion"], _body("completion", LONG, kv_transfer_params=params))
    assert resp.status_code == 502, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("KV pull from the prefill failed: rank 0: "), message
    after = d_fail.stats()
    assert after["pulls_failed"] == before["pulls_failed"] + 1
    assert after["requests_failed"] == before["requests_failed"] + 1
    assert after["blocks_free"] == before["blocks_free"]  # nothing leaked

    before = d_re.stats()
    assert _decode(d_re, "completion", LONG, params) == _colocated(c, "completion", LONG)
    after = d_re.stats()
    assert after["recomputed"] == before["recomputed"] + 1
    assert after["pulls_failed"] == before["pulls_failed"] + 1
    assert after["prefix_hits"] == before["prefix_hits"] + 1001 // ATTN_BLOCK
    assert after["blocks_free"] == before["blocks_free"]


def test_sigterm_stops_the_sidecars_and_leaves_nothing_behind(sims):
    d = sims["decode_recompute"]
    pid = d.child.pid
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        kids = [int(k) for k in fh.read().split()]
    assert len(kids) == 1  # one sidecar per rank
    with open(f"/proc/{kids[0]}/cmdline", "rb") as fh:
        argv = fh.read().decode().split("\0")
    engine_id = argv[argv.index("--engine-id") + 1].rsplit("-", 1)[0]
    sock_dir = os.path.dirname(argv[argv.index("--engine-socket") + 1])
    assert d.child.stop() == 0
    assert not os.path.exists(f"/proc/{kids[0]}/cmdline") or _zombie(kids[0])
    assert not [n for n in os.listdir("/dev/shm") if engine_id in n]
    assert not os.path.exists(sock_dir)
    with pytest.raises(httpx.ConnectError):
        httpx.get(d.url + "/health", timeout=5)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True
