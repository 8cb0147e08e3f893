"""Deterministic stand-ins for a tokenizer and a sampler (no model, no downloads).

``tokenize`` splits text into words and punctuation, cuts long words into pieces of at most
six characters and hashes each piece to an id, after a BOS token: the same prompt always gives
the same ids on every machine (a lone surrogate, which JSON allows, is a piece of its own).
``generate`` turns a 64-bit digest of a request's KV bytes into words, so the text is a pure
function of the KV content.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from functools import lru_cache

BOS = 1
VOCAB_SIZE = 32000
_FIRST_WORD_ID = 256
_PIECE_CHARS = 6
_PIECES = re.compile(r"\w+|[^\w\s]")

_WORD_LIST = (
    "the of and to in is that for it as with was on be by at this from are or an not have "
    "which one all were but had they when can there been if more their has will would who so "
    "no time up out only its some into than them two could other these may first then do any "
    "like my now over such our man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long here get both between "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three kernel cache block page layer tensor "
    "prefill decode token head state"
)
WORDS = tuple(_WORD_LIST.split())
"""What ``generate`` samples from."""


@lru_cache(maxsize=65536)
def _piece_id(piece: str) -> int:
    # A lone surrogate (JSON may escape one: "\ud800") has no UTF-8; vLLM serves such a prompt,
    # so it is hashed as its code point's bytes (surrogatepass), an id of its own.
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return _FIRST_WORD_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - _FIRST_WORD_ID)


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: BOS, then one id per word piece or punctuation mark."""
    ids = [BOS]
    for match in _PIECES.finditer(text):
        word = match.group()
        ids.extend(_piece_id(word[i : i + _PIECE_CHARS]) for i in range(0, len(word), _PIECE_CHARS))
    return ids


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text of a chat: each (role, content) as a tagged turn, then the reply tag."""
    turns = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(turns) + "<|assistant|>\n"


def prompt_seed(tokens: Sequence[int]) -> int:
    """The pattern seed of a prompt: a 63-bit hash of its token ids."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def generate(digest: int, n: int) -> list[str]:
    """``n`` token strings (each a space and a word) drawn by a PRNG seeded with ``digest``."""
    rng = random.Random(digest)
    return [" " + rng.choice(WORDS) for _ in range(n)]
