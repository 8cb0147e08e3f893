"""The demo's workload mixes every request shape and repeats prompts."""

from __future__ import annotations

from kvxferd.demo.workload import make_jobs


def test_jobs_cover_completions_and_chat_streaming_and_not() -> None:
    jobs = make_jobs(32)
    assert [j.index for j in jobs] == list(range(32))
    assert {(j.chat, j.stream) for j in jobs} == {(False, False), (False, True), (True, False),
                                                  (True, True)}  # fmt: skip
    assert all(1 <= j.max_tokens <= 32 for j in jobs)


def test_some_prompts_repeat_and_some_share_a_prefix() -> None:
    prompts = [j.prompt for j in make_jobs(32)]
    assert len(set(prompts)) < len(prompts)
    heads = [p[:2000] for p in prompts if len(p) > 2000]
    assert len(set(heads)) < len(heads)


def test_same_seed_same_jobs_other_seed_other_jobs() -> None:
    assert make_jobs(8, seed=3) == make_jobs(8, seed=3)
    assert make_jobs(8, seed=3) != make_jobs(8, seed=4)
