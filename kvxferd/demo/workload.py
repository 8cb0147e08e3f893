"""The demo's requests: a seeded mix of completions and chats, streaming and not, with shared
prefixes and exact repeats so the decode's prefix cache gets partial and full hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_VOCAB = (
    "cache block page layer head token prefill decode transfer state window group region "
    "engine sidecar ticket hold pull notify lease peer manifest stride offset verify byte "
    "model prompt stream chunk rank tensor memory pool shared loopback agent descriptor"
)
_WORDS = tuple(_VOCAB.split(" "))


@dataclass(frozen=True)
class Job:
    """One request the demo sends (and the colocated reference answers)."""

    index: int
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int

    @property
    def key(self) -> tuple[bool, str, int]:
        """Requests with the same key must get the same text."""
        return (self.chat, self.prompt, self.max_tokens)


def make_jobs(count: int, seed: int = 0) -> list[Job]:
    """``count`` jobs: every 4th repeats an earlier prompt, every 3rd extends a shared prefix."""
    rng = random.Random(seed)
    shared = _text(rng, 900)
    jobs: list[Job] = []
    for i in range(count):
        if i % 4 == 3 and jobs:
            prompt = jobs[rng.randrange(len(jobs))].prompt
        elif i % 3 == 2:
            prompt = shared + " " + _text(rng, rng.randrange(20, 400))
        else:
            prompt = _text(rng, rng.randrange(40, 1600))
        jobs.append(Job(i, chat=i % 2 == 1, stream=i % 5 in (1, 2), prompt=prompt,
                        max_tokens=rng.randrange(8, 33)))  # fmt: skip
    return jobs


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))
