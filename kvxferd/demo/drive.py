"""Send jobs to an OpenAI-compatible URL with the official ``openai`` client, ``concurrency`` at
a time, and record each answer's text, error and end-to-end latency (to the last byte).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from kvxferd.demo.workload import Job


@dataclass(frozen=True)
class Outcome:
    """What one job got back."""

    job: Job
    text: str | None
    error: str | None
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


async def drive(
    base_url: str,
    model: str,
    jobs: Sequence[Job],
    concurrency: int,
    timeout_s: float,
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Run every job (``base_url`` ends in ``/v1``); outcomes come back in job order."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> Outcome:
        async with gate:
            start = time.perf_counter()
            try:
                text = await _ask(client, model, job)
                error = None
            except openai.OpenAIError as exc:
                text, error = None, f"{type(exc).__name__}: {exc}"
            outcome = Outcome(job, text, error, time.perf_counter() - start)
        if on_done is not None:
            on_done(outcome)
        return outcome

    try:
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        await client.close()


async def _ask(c: openai.AsyncOpenAI, model: str, job: Job) -> str:
    """The answer's full text, assembled from the chunks when streaming."""
    if job.chat:
        messages: list[Any] = [{"role": "user", "content": job.prompt}]
        if not job.stream:
            reply = await c.chat.completions.create(
                model=model, messages=messages, max_tokens=job.max_tokens
            )
            return reply.choices[0].message.content or ""
        parts = []
        stream = await c.chat.completions.create(
            model=model, messages=messages, max_tokens=job.max_tokens, stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)
    if not job.stream:
        reply = await c.completions.create(
            model=model, prompt=job.prompt, max_tokens=job.max_tokens
        )
        return reply.choices[0].text
    parts = []
    stream = await c.completions.create(
        model=model, prompt=job.prompt, max_tokens=job.max_tokens, stream=True
    )
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
    return "".join(parts)


class Progress:
    """Progress on stderr: one rewritten line on a terminal, else a line every ~10 %."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.failed = 0
        self._tty = sys.stderr.isatty()
        self._step = max(1, total // 10)

    def __call__(self, outcome: Outcome) -> None:
        self.done += 1
        self.failed += 0 if outcome.ok else 1
        line = f"{self.label}: {self.done}/{self.total} done, {self.failed} failed"
        if self._tty:
            end = "\n" if self.done == self.total else ""
            print("\r" + line, end=end, file=sys.stderr, flush=True)
        elif self.done % self._step == 0 or self.done == self.total:
            print(line, file=sys.stderr, flush=True)
