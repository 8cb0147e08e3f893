"""A prefill's tickets bound to the prompt they were computed for.

The tickets are signed, but nothing in them names the prompt: a client could send a decode one
prompt with the tickets of another prompt's prefill, and vLLM would cache the pulled blocks under
the first prompt's hashes and serve them to every later request sharing that prefix (a poisoned
prefix cache, across users). So the prefill's scheduler signs, with the peer secret every
engine's scheduler reads, what decides the KV bytes of the tokens the tickets cover (token ids,
LoRA adapter, multimodal inputs) together with their hold id; the decode's scheduler checks its
own request against that before anything is loaded, and drops params that do not match.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from typing import Any

from kvxferd.errors import InvalidRequestError
from kvxferd.wire import transfer_params as tp

FIELD = "kvxferd_prompt_mac"
"""The kv_transfer_params key carrying the binding (64 hex digits)."""


def prompt_mac(secret: bytes, hold_id: str, request: Any, num_tokens: int) -> str | None:
    """The binding of ``hold_id`` to ``request``'s first ``num_tokens`` tokens (None for a
    prompt given as embeddings: no token ids to bind)."""
    tokens = request.prompt_token_ids
    if tokens is None or len(tokens) < num_tokens:
        return None
    h = hashlib.sha256(b"kvxferd-prompt/1\0%s\0%d\0" % (hold_id.encode(), num_tokens))
    h.update(array("q", tokens[:num_tokens]).tobytes())
    lora = getattr(request, "lora_request", None)
    h.update(b"\0lora\0" + str(getattr(lora, "lora_name", "") if lora else "").encode())
    for f in getattr(request, "mm_features", None) or ():
        h.update(b"\0mm\0%s\0%s" % (str(f.identifier).encode(), str(f.mm_position).encode()))
    return hmac.new(secret, h.digest(), "sha256").hexdigest()


def check(secret: bytes, params: dict[str, Any], hold_id: str, request: Any, n: int) -> None:
    """InvalidRequestError unless ``params`` bind ``hold_id`` to this request's first ``n``
    tokens."""
    theirs = params.get(FIELD)
    mine = prompt_mac(secret, hold_id, request, n)
    if not isinstance(theirs, str) or mine is None or not hmac.compare_digest(theirs, mine):
        raise InvalidRequestError(
            f"{tp.FIELD}.{FIELD}", "missing, or does not bind the tickets to this prompt"
        )
