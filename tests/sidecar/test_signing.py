"""Peer request signatures: what is signed, the replay window, remembered nonces, rotation, and
that neither the header nor the key id carries the secret."""

from __future__ import annotations

import pytest

from kvxferd.errors import AuthError, ConfigError, SignedBeforeStartError
from kvxferd.sidecar.signing import (
    PeerKeys,
    RequestVerifier,
    SignFloors,
    key_id,
    parse_header,
    request_target,
    sign_request,
)

SECRET = "a shared peer secret"
KEYS = PeerKeys.of(SECRET)
BODY = b'{"hold_ids": ["h"], "extend_s": 5.0}'


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def verifier(keys: PeerKeys = KEYS, **kw) -> tuple[RequestVerifier, Clock]:
    clock = Clock()
    return RequestVerifier(keys, clock=clock, **kw), clock


def header(clock: Clock, keys: PeerKeys = KEYS, method="POST", target="/v1/heartbeat",
           body=BODY, **kw) -> str:  # fmt: skip
    return sign_request(keys, method, target, body, now=clock.t, **kw)


def test_a_signed_request_verifies_once_and_names_its_key():
    v, clock = verifier()
    h = header(clock)
    assert v.verify("POST", "/v1/heartbeat", BODY, h) == key_id(SECRET.encode())
    with pytest.raises(AuthError, match="replayed"):
        v.verify("POST", "/v1/heartbeat", BODY, h)


def test_the_header_and_the_key_id_never_carry_the_secret():
    h = header(Clock())
    raw = SECRET.encode()
    assert raw not in h.encode() and raw.hex() not in h
    assert set(parse_header(h)) == {"key", "ts", "nonce", "sig"}
    assert len(key_id(raw)) == 16 and key_id(raw) != key_id(b"another")


def test_the_keys_never_show_the_secret_when_printed():
    keys = PeerKeys.of(SECRET, "the previous secret")
    for text in (repr(keys), str(keys), f"{keys!r}"):
        assert SECRET not in text and "the previous secret" not in text


@pytest.mark.parametrize(
    ("method", "target", "body"),
    [("GET", "/v1/heartbeat", BODY), ("POST", "/v1/claims", BODY),
     ("POST", "/v1/heartbeat?x=1", BODY), ("POST", "/v1/heartbeat", BODY + b" ")],
    ids=["method", "path", "query", "body"],
)  # fmt: skip
def test_every_signed_part_is_checked(method, target, body):
    v, clock = verifier()
    with pytest.raises(AuthError, match="signature does not match"):
        v.verify(method, target, body, header(clock))
    assert len(v) == 0  # a refused request leaves no nonce behind


def test_the_replay_window_is_both_ways_and_nonces_are_forgotten_after_it():
    v, clock = verifier(skew_s=30.0)
    for offset in (-31, 31):
        with pytest.raises(AuthError, match="window"):
            v.verify("POST", "/v1/heartbeat", BODY, header(Clock(clock.t + offset)))
    h = header(clock, nonce="ab" * 8)
    v.verify("POST", "/v1/heartbeat", BODY, h)
    clock.t += 30.5
    with pytest.raises(AuthError, match="window"):  # its replay is stale now
        v.verify("POST", "/v1/heartbeat", BODY, h)
    v.verify("POST", "/v1/heartbeat", BODY, header(clock))
    assert len(v) == 1  # the old nonce was forgotten once out of the window


def test_the_nonce_memory_is_bounded_and_fails_closed_when_full():
    v, clock = verifier(max_nonces=3)
    for _ in range(3):
        v.verify("POST", "/v1/heartbeat", BODY, header(clock))
    with pytest.raises(AuthError, match="too many"):
        v.verify("POST", "/v1/heartbeat", BODY, header(clock))
    clock.t += 31
    v.verify("POST", "/v1/heartbeat", BODY, header(clock))
    assert len(v) == 1


def test_a_foreign_key_or_a_malformed_header_is_refused():
    v, clock = verifier()
    with pytest.raises(AuthError, match="unknown key id"):
        v.verify("POST", "/v1/heartbeat", BODY, header(clock, PeerKeys.of("other")))
    good = header(clock)
    for bad in (None, "", "Bearer x", good.replace("KVX1", "KVX2"), good + ", key=00",
                good.replace("sig=", "sig=0"), good.replace("nonce=", "nonce=zz")):  # fmt: skip
        with pytest.raises(AuthError):
            v.verify("POST", "/v1/heartbeat", BODY, bad)


def test_a_time_that_is_not_decimal_is_refused_as_malformed():
    """The header's digits are hex for every parameter but ``ts``: a ts of hex letters under
    our key id (it travels in clear) is an AuthError, not a ValueError (a 500, logged)."""
    v, clock = verifier()
    good = header(clock)
    bad = good.replace(f"ts={int(clock.t)}", "ts=abc")
    assert bad != good
    with pytest.raises(AuthError, match="ts"):
        parse_header(bad)
    with pytest.raises(AuthError, match="ts"):
        v.verify("POST", "/v1/heartbeat", BODY, bad)


def test_during_a_rollover_both_keys_verify_and_only_the_current_one_signs():
    old, new = "old-secret", "new-secret"
    moved = PeerKeys.of(new, old)
    assert moved.current == new.encode() and moved.accepted == (new.encode(), old.encode())
    v, clock = verifier(moved)
    v.verify("POST", "/v1/heartbeat", BODY, header(clock, PeerKeys.of(old)))
    v.verify("POST", "/v1/heartbeat", BODY, header(clock, PeerKeys.of(new)))
    assert parse_header(header(clock, moved))["key"] == key_id(new.encode())
    assert PeerKeys.of(new, new).accepted == (new.encode(),)
    with pytest.raises(ConfigError):
        PeerKeys.of("")


def test_the_target_is_the_path_plus_its_query():
    assert request_target("/v1/released") == "/v1/released"
    assert request_target("/v1/released", b"cursor=3") == "/v1/released?cursor=3"


def call(v: RequestVerifier, h: str) -> str:
    return v.verify("POST", "/v1/heartbeat", BODY, h)


def test_a_replay_is_refused_after_the_clock_steps_back_past_the_forgotten_nonce():
    """A call's nonce is forgotten once its ts leaves the window; if the clock then steps back
    (NTP, a VM restored) so that ts is inside the window again, the captured call is still
    refused: it is older than the window of the latest time the clock showed."""
    v, clock = verifier(skew_s=30.0)
    captured = header(clock)
    call(v, captured)
    clock.t += 31
    call(v, header(clock))  # another call: the captured nonce is forgotten now
    assert len(v) == 1
    clock.t -= 31  # stepped back: the captured ts is within ±30 s of the clock again
    with pytest.raises(AuthError, match="clock stepped back") as refused:
        call(v, captured)
    assert "older than the replay window" in str(refused.value)
    assert len(v) == 1  # the refused replay left no nonce behind


def test_after_a_step_back_past_the_window_fresh_calls_fail_closed_until_the_clock_catches_up():
    """Honest calls signed at the stepped-back time are refused (nothing proves them unseen)
    for as long as the step exceeds the window; a step back within the window costs nothing."""
    v, clock = verifier(skew_s=30.0)
    latest = clock.t
    call(v, header(clock))
    clock.t -= 10  # within the window: honest calls go on
    call(v, header(clock))
    clock.t = latest - 60  # 60 s back: refused for 60 - 30 s
    with pytest.raises(AuthError, match="clock stepped back 60.0 s"):
        call(v, header(clock))
    clock.t = latest - 31
    with pytest.raises(AuthError, match="older than the replay window"):
        call(v, header(clock))
    clock.t = latest - 30  # back within the window of the latest time seen
    call(v, header(clock))
    assert len(v) == 3


def test_a_forward_step_that_is_undone_refuses_honest_calls_for_the_step_less_the_window():
    v, clock = verifier(skew_s=30.0)
    true = clock.t
    clock.t = true + 100  # wrong by 100 s: honest peers (at the true time) are out of the window
    with pytest.raises(AuthError, match=r"ts is \+100 s from our clock"):
        call(v, header(Clock(true)))
    clock.t = true  # corrected; the high-water mark stays at true + 100
    with pytest.raises(AuthError, match="clock stepped back 100.0 s"):
        call(v, header(clock))
    clock.t = true + 70  # 100 - 30 s later they are accepted again
    call(v, header(clock))


def test_over_a_long_run_with_small_steps_back_nonces_age_out_and_none_is_accepted_twice():
    """Thousands of distinct calls, the clock moving on 0.5 s a call and stepping back 5 s every
    100 calls (within the window: every honest call is accepted): the nonce table holds only
    the calls whose ts is within 30 s of the latest time seen, nothing is accepted twice (calls
    29 to 35 s old are replayed after every call, those whose nonces were just forgotten among
    them) and the table empties once the clock has moved past the window."""
    v, clock = verifier(skew_s=30.0, max_nonces=200)
    step, lags = 0.5, (58, 62, 66, 70)  # calls 29, 31, 33 and 35 s back
    sent: list[str] = []
    for i in range(4000):
        clock.t += step
        if i % 100 == 99:
            clock.t -= 5.0
        sent.append(header(clock))
        call(v, sent[-1])
        assert len(v) <= (30.0 + 5.0) / step + 2  # ts of the last 30 s, 5 s of them twice
        for lag in lags:
            if i >= lag:
                with pytest.raises(AuthError):
                    call(v, sent[i - lag])
    clock.t += 36
    call(v, header(clock))
    assert len(v) == 1


def test_after_a_restart_any_ts_its_predecessor_could_have_accepted_is_refused_naming_the_floor():
    """The predecessor accepted ts up to its clock plus skew_s, its clock below our start."""
    clock = Clock()
    v = RequestVerifier(KEYS, clock=clock, skew_s=30.0, started=clock.t - 0.5)
    assert v.not_before == int(clock.t) + 30  # the first whole second after start + skew_s
    # What the predecessor accepted just before it stopped, from a peer whose clock ran ahead:
    captured = sign_request(KEYS, "POST", "/v1/heartbeat", BODY, now=clock.t + 29)
    with pytest.raises(SignedBeforeStartError, match="sign it again") as refused:
        v.verify("POST", "/v1/heartbeat", BODY, captured)
    assert refused.value.not_before == v.not_before


@pytest.mark.parametrize("offset", [-30.0, 0.0, 30.0], ids=["behind", "on-time", "ahead"])
def test_a_peer_whatever_its_clock_gets_in_by_signing_again_at_the_floor(offset):
    clock = Clock()
    v = RequestVerifier(KEYS, clock=clock, skew_s=30.0, started=clock.t - 0.25)
    ts = max(clock.t + offset, v.not_before)  # what our client signs at after the 401
    assert v.verify("POST", "/v1/heartbeat", BODY, header(Clock(ts))) == key_id(SECRET.encode())


def test_the_floor_is_no_way_around_the_replay_window_once_it_passed():
    clock = Clock()
    v = RequestVerifier(KEYS, clock=clock, skew_s=30.0, started=clock.t)
    h = header(Clock(v.not_before))
    v.verify("POST", "/v1/heartbeat", BODY, h)
    clock.t = v.not_before + 31  # the nonce is forgotten now: its ts must be refused as stale
    with pytest.raises(AuthError, match="from our clock"):
        v.verify("POST", "/v1/heartbeat", BODY, h)


def test_our_client_signs_at_a_restarted_peers_floor_until_its_clock_passes_it():
    clock = Clock(100.0)
    floors = SignFloors(limit=2, clock=clock)
    assert floors.ts("p:1") == 100.0
    assert floors.learn("p:1", 130) and not floors.learn("p:1", 130)  # signed again once
    assert not floors.learn("p:1", 0)  # not a restart's 401
    assert floors.ts("p:1") == 130 and floors.ts("q:1") == 100.0
    clock.t = 131.0
    assert floors.ts("p:1") == 131.0
    assert floors.learn("p:1", 160)
    floors.forget("p:1")
    assert floors.ts("p:1") == 131.0
