#!/usr/bin/env python3
"""What reading a front door's request body costs: time and memory of the proxy's
``jsonbody.parse`` and the sim's ``protocol.parse`` on hostile and legitimate bodies.

Bodies (``--mib`` large, 32 by default, the front doors' body limit):

- ``many-keys``: one object of ~3 million short top-level keys (``{"0":0,"1":0,...}``), the
  hostile body: each key is a str and a ``msgspec.Raw`` once parsed;
- ``colon-prompt``: a completions body whose prompt is one string of colons (a colon count
  bounds the keys from above; this body must still be read);
- ``chat``: a chat body of ~80-byte messages (one top-level key, many nested ones);
- ``normal``: a 2 KB completions body (timed over many calls).

Per body and reader: the median wall time and the peak of memory allocated while it runs
(``tracemalloc``, in a separate untimed call: tracing slows it; the body itself was allocated
before), and how it ended (the keys read, or the error's type). ``bytes.count(b":")`` is timed
beside them: the cheap upper bound on keys that was considered. The sim reads only the hostile
and the normal body unless ``--sim``: past reading, it tokenizes a prompt and builds the
messages. Only public calls: ``PYTHONPATH`` at another checkout measures that one.

Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_jsonbody.py`` (``--json PATH`` for the rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from collections.abc import Callable

import msgspec
from benchlib.timing import median_s

from kvxferd.api import jsonbody
from kvxferd.sim import protocol


def many_keys(size: int) -> bytes:
    """An object of as many short distinct top-level keys as fit ``size`` bytes."""
    parts, n = [], 2
    while n < size - 24:
        part = b'"%x":0' % len(parts)
        parts.append(part)
        n += len(part) + 1
    return b"{" + b",".join(parts) + b"}"


def colon_prompt(size: int) -> bytes:
    head = b'{"model":"m","max_tokens":16,"prompt":"'
    return head + b":" * (size - len(head) - 2) + b'"}'


def chat(size: int) -> bytes:
    message = {"role": "user", "content": 'Q: what is 12: a number? answer: {"a": [1, 2]}'}
    one = len(msgspec.json.encode(message)) + 1
    return msgspec.json.encode(
        {"model": "m", "max_tokens": 16, "messages": [message] * (size // one - 1)}
    )


def normal() -> bytes:
    prompt = "Summarise: the cache moves from prefill to decode. Note: pages of 16 tokens. " * 24
    body = {"model": "m", "prompt": prompt[:1900], "max_tokens": 64, "temperature": 0.7,
            "top_p": 0.95, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    return msgspec.json.encode(body)


def outcome(fn: Callable[[], object]) -> str:
    """How a call ended: the keys read, else the error's type."""
    try:
        got = fn()
    except Exception as exc:  # the refusal is what is measured
        return type(exc).__name__
    return f"{len(got)} keys" if isinstance(got, dict) else "read"


def measure(fn: Callable[[], object], repeat: int) -> dict[str, float | str]:
    def quiet() -> None:
        outcome(fn)

    seconds = median_s(quiet, repeat, warmup=1 if repeat > 1 else 0)
    tracemalloc.start()
    try:
        ended = outcome(fn)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"ms": seconds * 1e3, "peak_mb": peak / 1e6, "outcome": ended}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="size of the large bodies (default 32)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per large body, median")
    ap.add_argument(
        "--sim",
        action="store_true",
        help="the sim on every body (it tokenizes "
        "the prompt and builds the messages: tens of seconds on 32 MiB)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    size = args.mib << 20
    bodies = {"many-keys": many_keys(size), "colon-prompt": colon_prompt(size),
              "chat": chat(size), "normal": normal()}  # fmt: skip
    print(f"{'body':>13} {'bytes':>10} {'reader':>14} {'ms':>9} {'peak MB':>8}  outcome")
    rows = []
    for name, body in bodies.items():
        repeat = args.repeat if len(body) > 1 << 20 else 1000
        kind = "chat" if name == "chat" else "completion"
        readers: dict[str, Callable[[], object]] = {
            "count(':')": lambda body=body: body.count(b":"),
            "proxy parse": lambda body=body: jsonbody.parse(body),
        }
        if args.sim or name in ("many-keys", "normal"):
            readers["sim parse"] = lambda body=body, kind=kind: protocol.parse(kind, body, "m")
        for reader, fn in readers.items():
            row = {"body": name, "bytes": len(body), "reader": reader, **measure(fn, repeat)}
            rows.append(row)
            print(f"{name:>13} {len(body):>10} {reader:>14} {row['ms']:>9.3f} "
                  f"{row['peak_mb']:>8.1f}  {row['outcome']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version.split()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
