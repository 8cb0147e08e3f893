"""Peer request signatures: the shared secret authenticates every peer call and never travels.

A request carries ``Authorization: KVX1 key=<key id>, ts=<unix s>, nonce=<hex>, sig=<hex>``,
``sig`` being HMAC-SHA256, under a key derived from the secret, of
``KVX1\\n<METHOD>\\n<path?query>\\n<sha256(body) hex>\\n<ts>\\n<nonce>\\n<key id>``. The server
accepts it when the key id names one of its keys (the current one, or a second one during a
rollover), ``ts`` is within ``skew_s`` of its clock (and of the latest time that clock showed,
so a clock stepping back reopens no replay), the signature matches (constant-time) and the nonce
was not seen within the window (a replay is refused). Nonces live in memory, so a process refuses
any ``ts`` its predecessor (before a restart) could have accepted: a 401 naming ``not_before``,
which our own client answers by signing again at that ts. A key id is an HMAC of a fixed label
under the key: it names the key without revealing it.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import hmac
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvxferd.errors import AuthError, ConfigError, SignedBeforeStartError

SCHEME = "KVX1"
DEFAULT_SKEW_S = 30.0
MAX_NONCES = 1 << 17
"""Nonces remembered at once (about 2,000 signed requests a second over a 60 s window)."""
_REQUEST_LABEL = b"kvxferd peer request v1"
_KEY_ID_LABEL = b"kvxferd key id v1"
_PARAM = re.compile(r"^\s*(key|ts|nonce|sig)=([0-9a-f]+)\s*$")
_LENGTHS = {"key": (16, 16), "ts": (1, 12), "nonce": (16, 64), "sig": (64, 64)}


def key_id(secret: bytes) -> str:
    """Public name of a secret: 16 hex characters of an HMAC of a fixed label under it."""
    return hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class PeerKeys:
    """The secrets this sidecar holds: ``current`` signs (requests and tickets), every one of
    ``accepted`` verifies (the current one first, then a rollover's other key)."""

    current: bytes = field(repr=False)
    accepted: tuple[bytes, ...] = field(repr=False)

    @classmethod
    def of(cls, current: str | bytes, other: str | bytes = b"") -> PeerKeys:
        """Keys from the configured secret and an optional second one accepted in a rollover."""
        cur = current.encode() if isinstance(current, str) else bytes(current)
        second = other.encode() if isinstance(other, str) else bytes(other)
        if not cur:
            raise ConfigError("peer_token: the peer secret must not be empty")
        return cls(cur, (cur, second) if second and second != cur else (cur,))

    def request_key(self, secret: bytes) -> bytes:
        """The key requests are signed with (derived, so a request MAC is never a ticket MAC)."""
        return hmac.new(secret, _REQUEST_LABEL, hashlib.sha256).digest()

    @functools.cached_property
    def signer(self) -> tuple[str, bytes]:
        """``(key id, request key)`` of the current secret, derived once (every claim signs)."""
        return key_id(self.current), self.request_key(self.current)


def _message(method: str, target: str, body: bytes, ts: str, nonce: str, kid: str) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return f"{SCHEME}\n{method.upper()}\n{target}\n{digest}\n{ts}\n{nonce}\n{kid}".encode()


def sign_request(
    keys: PeerKeys, method: str, target: str, body: bytes, *, now: float | None = None,
    nonce: str | None = None,
) -> str:  # fmt: skip
    """The Authorization header value of one request (``target`` is its path and query)."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(16)
    kid, key = keys.signer
    sig = hmac.new(key, _message(method, target, body, ts, nonce, kid), hashlib.sha256).hexdigest()
    return f"{SCHEME} key={kid}, ts={ts}, nonce={nonce}, sig={sig}"


def parse_header(value: str) -> dict[str, str]:
    """The parameters of a KVX1 Authorization header; AuthError names what is wrong."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme.upper() != SCHEME:
        raise AuthError(f"Authorization: expected the {SCHEME} scheme")
    params: dict[str, str] = {}
    for item in rest.split(","):
        match = _PARAM.match(item)
        if match is None or match[1] in params:
            raise AuthError("Authorization: malformed KVX1 parameters")
        low, high = _LENGTHS[match[1]]
        if not low <= len(match[2]) <= high:
            raise AuthError(f"Authorization: {match[1]} has the wrong length")
        if match[1] == "ts" and not match[2].isdigit():  # the others are hex
            raise AuthError("Authorization: ts must be decimal Unix seconds")
        params[match[1]] = match[2]
    if len(params) != len(_LENGTHS):
        raise AuthError("Authorization: key, ts, nonce and sig are all required")
    return params


class RequestVerifier:
    """Checks signed peer requests: key, time window, signature, then nonce (replays refused).

    Nonces are remembered until their timestamp leaves the window, at most ``max_nonces`` at
    once; when full, new requests are refused (fail closed) until old nonces age out.

    The window is measured against the latest time the clock ever showed this verifier (its
    high-water mark), not only against the clock now: a nonce is forgotten once its ``ts`` is
    ``skew_s`` behind that mark, and a request whose ``ts`` is that old is refused even when a
    clock stepped back (an NTP correction of a fast clock, a VM restored) says it is within the
    window: its nonce may have been forgotten, so it cannot be proven unseen. A replay is thus
    refused whatever the wall clock does. The price is paid by honest peers, never by a replay
    (fail closed): after the clock steps back by ``X`` > ``skew_s``, calls signed at the new time
    are refused for about ``X - skew_s`` s, until it catches up with the mark; a forward step of
    ``D`` that is then undone refuses honest calls for about ``D - skew_s`` s after the return
    (and while the clock is ahead, as any skew beyond the window does). Steps of at most
    ``skew_s`` cost nothing. The mark lives in memory, like the nonces: a VM restored from a
    snapshot with this process in it resets both (no in-process check helps).

    A restart also forgets the nonces, so the verifier of a process that ``started`` (Unix s)
    refuses every ``ts`` below ``not_before``, the first whole second after ``started +
    skew_s``: a process before it accepted only ``ts`` within ``skew_s`` of a clock that showed
    less than that start, so nothing it saw can be replayed. An honest peer, whatever its
    clock, signs again at ``not_before`` (always inside the window, so no wait). Without
    ``started`` (a verifier that outlives no process: tests) there is no such floor.
    """

    def __init__(
        self, keys: PeerKeys, *, skew_s: float = DEFAULT_SKEW_S, max_nonces: int = MAX_NONCES,
        clock: Callable[[], float] = time.time, started: float | None = None,
    ) -> None:  # fmt: skip
        if not (math.isfinite(skew_s) and skew_s > 0):
            raise ConfigError(f"auth_skew_s: must be > 0, got {skew_s!r}")
        if max_nonces < 1:
            raise ConfigError(f"max_nonces: must be >= 1, got {max_nonces!r}")
        self._keys = {key_id(k): keys.request_key(k) for k in keys.accepted}
        self.skew_s = float(skew_s)
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # (time the nonce may be forgotten, nonce)
        self._latest = -math.inf  # the latest time the clock showed: never moves back
        self.not_before = 0 if started is None else not_before(started, self.skew_s)
        """The earliest ``ts`` accepted: later than any a predecessor process accepted."""

    def __len__(self) -> int:
        return len(self._seen)

    def verify(self, method: str, target: str, body: bytes, header: str | None) -> str:
        """Return the key id that signed the request, or raise AuthError (never says which
        secret was expected)."""
        if not header:
            raise AuthError(f"Authorization: missing (peer calls are signed, scheme {SCHEME})")
        p = parse_header(header)
        key = self._keys.get(p["key"])
        if key is None:
            raise AuthError("Authorization: unknown key id (another secret, or rotated out)")
        now = self._clock()
        self._latest = latest = max(self._latest, now)
        ts = int(p["ts"])
        # The earliest ts accepted is always within the window (a retry signed at it is never
        # refused, though not_before is up to a second more than skew_s ahead at the start).
        if now - ts > self.skew_s or (ts - now > self.skew_s and ts != self.not_before):
            raise AuthError(
                f"Authorization: ts is {now - ts:+.0f} s from our clock (window ±{self.skew_s:g} s)"
            )
        # Only after a backward clock step can a ts within the window of ``now`` be out of the
        # window of ``latest``: _forget may already have dropped a nonce that old (it tests the
        # same expression, so no float rounding slips between them), and accepting the request
        # could accept a replay. Checked before the signature, like the window above.
        if ts + self.skew_s < latest:
            raise AuthError(
                f"Authorization: ts is older than the replay window: our clock stepped back "
                f"{latest - now:.1f} s and ts is {latest - ts:.0f} s before the latest time it "
                f"showed (window ±{self.skew_s:g} s); refused until the clock catches up"
            )
        if ts < self.not_before:
            raise SignedBeforeStartError(
                f"Authorization: ts {ts} is before {self.not_before}, the earliest this sidecar "
                f"accepts since it (re)started: a request signed earlier may have been seen "
                f"before the restart; sign it again with ts >= {self.not_before}",
                self.not_before,
            )
        want = hmac.new(key, _message(method, target, body, p["ts"], p["nonce"], p["key"]),
                        hashlib.sha256).hexdigest()  # fmt: skip
        if not hmac.compare_digest(want.encode(), p["sig"].encode()):
            raise AuthError("Authorization: signature does not match the request")
        self._forget(latest)
        if p["nonce"] in self._seen:
            raise AuthError("Authorization: nonce already used (replayed request)")
        if len(self._seen) >= self.max_nonces:
            raise AuthError("Authorization: too many signed requests in the window; retry")
        self._seen.add(p["nonce"])
        heapq.heappush(self._expiry, (ts + self.skew_s, p["nonce"]))
        return p["key"]

    def _forget(self, latest: float) -> None:
        """Drop nonces whose timestamp is out of the window of the clock's high-water mark
        (verify refuses a replay of them as stale, whatever the clock says later)."""
        expiry = self._expiry
        while expiry and expiry[0][0] < latest:
            self._seen.discard(heapq.heappop(expiry)[1])


def not_before(started: float, skew_s: float) -> int:
    """The earliest ``ts`` the verifier of a process that started at ``started`` (Unix s)
    accepts: the first whole second after ``started + skew_s``."""
    return math.floor(started + skew_s) + 1


class SignFloors:
    """The earliest ``ts`` each peer that restarted lately accepts (its 401 named it), so the
    next calls sign at it instead of each taking a 401 first; at most ``limit`` peers (a floor
    lost costs one more 401 and signing again)."""

    def __init__(self, limit: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self._floors: dict[str, int] = {}
        self._limit = limit
        self._clock = clock

    def ts(self, address: str) -> float:
        """The time to sign a call to ``address`` at: now, or its floor while that is later."""
        now = self._clock()
        floor = self._floors.get(address, 0)
        if floor <= now:
            self._floors.pop(address, None)
        return max(now, floor)

    def learn(self, address: str, floor: int) -> bool:
        """Remember a floor ``address`` named; whether it is new (then sign the call again)."""
        if floor <= self._floors.get(address, 0):
            return False  # not such a 401 (0), or one we signed at already
        if len(self._floors) >= self._limit:
            self._floors.clear()
        self._floors[address] = floor
        return True

    def forget(self, address: str) -> None:
        """Drop ``address``'s floor (the peer was dropped)."""
        self._floors.pop(address, None)


def request_target(path: str, query: bytes | str = b"") -> str:
    """The signed target of a request: its path, plus ``?query`` when there is one."""
    q = query.decode("latin-1") if isinstance(query, bytes) else query
    return f"{path}?{q}" if q else path


def accepted_ids(keys: PeerKeys) -> Iterable[str]:
    """Key ids a verifier built from ``keys`` accepts (for logs and the docs; never keys)."""
    return tuple(key_id(k) for k in keys.accepted)
