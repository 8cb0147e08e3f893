"""The lookup's minimum-prefix rule: per-group coverage, a Mamba state must sit exactly at the
end of the match, and groups that disagree are a warning, never an error."""

from __future__ import annotations

import logging

import pytest

from kvxferd.errors import StoreError
from kvxferd.store import chunk_keys
from tests.store.helpers import MAMBA2, filled, plan, store

CHUNK = 64


@pytest.fixture
def hybrid():
    return plan(MAMBA2, blocks=24)


def _prompt(n):  # noqa: ANN001
    return list(range(1000, 1000 + n))


def _save(s, m, n):  # noqa: ANN001
    regions, ids = filled(m, n, seed=n)
    s.save(m, regions, ids, chunk_keys(_prompt(n), CHUNK), n)


def _lookup(s, m, n):  # noqa: ANN001
    return s.lookup(m, chunk_keys(_prompt(n), CHUNK), n)


def test_the_saved_prompt_matches_in_full(tmp_path, hybrid):
    s = store(tmp_path, CHUNK)
    _save(s, hybrid, 400)
    hit = _lookup(s, hybrid, 400)
    assert hit.matched == 400 and not hit.disagree


def test_state_at_another_boundary_gives_no_match_and_a_warning(tmp_path, hybrid, caplog):
    s = store(tmp_path, CHUNK)
    _save(s, hybrid, 400)  # state at token 400, under the key of the partial chunk [384, 400)
    with caplog.at_level(logging.WARNING, logger="kvxferd.store.store"):
        hit = _lookup(s, hybrid, 800)
    attention = hybrid.groups.index(next(g for g in hybrid.groups if g.kind != "mamba"))
    assert hit.per_group[attention] == 384
    assert hit.matched == 0 and hit.disagree
    assert "disagree" in caplog.text
    assert s.disagreements == 1


def test_a_state_at_a_chunk_boundary_serves_longer_prompts(tmp_path, hybrid):
    s = store(tmp_path, CHUNK)
    _save(s, hybrid, 400)
    _save(s, hybrid, 384)  # ends on a chunk boundary: its state serves any longer prompt
    hit = _lookup(s, hybrid, 800)
    assert hit.matched == 384
    assert not hit.disagree  # attention also ends at 384: chunk [384, 448) was never saved


def test_missing_attention_chunk_caps_the_match_below_every_state(tmp_path, hybrid):
    s = store(tmp_path, CHUNK)
    _save(s, hybrid, 384)
    victim = chunk_keys(_prompt(384), CHUNK)[2]
    for f in tmp_path.rglob(f"{victim}-*"):
        f.unlink()
    s2 = store(tmp_path, CHUNK)
    hit = s2.lookup(hybrid, chunk_keys(_prompt(384), CHUNK), 384)
    assert hit.matched == 0  # attention covers 128 tokens, but no state sits at 128
    assert sorted(set(hit.per_group)) == [128, 384]


def test_dense_match_is_the_leading_run_of_chunks(tmp_path):
    m = plan("llama-3.1-8b", blocks=8)
    s = store(tmp_path, 16)
    regions, ids = filled(m, 64, seed=1)
    s.save(m, regions, ids, chunk_keys(_prompt(64), 16), 64)
    longer = _prompt(64) + [7] * 30
    assert s.lookup(m, chunk_keys(longer, 16), len(longer)).matched == 64
    other = [5] + _prompt(63)
    assert s.lookup(m, chunk_keys(other, 16), 64).matched == 0


def test_keys_must_match_the_token_count(tmp_path):
    m = plan("llama-3.1-8b", blocks=4)
    with pytest.raises(StoreError) as err:
        store(tmp_path, 16).lookup(m, chunk_keys(_prompt(40), 16), 60)
    assert err.value.field == "keys"
    with pytest.raises(StoreError) as err:
        store(tmp_path, 16).lookup(m, ["XYZ"], 10)
    assert err.value.field == "keys[0]"
    with pytest.raises(StoreError) as err:  # a key names a file: nothing after its digits
        store(tmp_path, 16).lookup(m, ["a" * 32 + "\n"], 10)
    assert err.value.field == "keys[0]"


def test_chunk_keys_chain_the_whole_prefix():
    a = chunk_keys([1, 2, 3, 4, 5], 2)
    b = chunk_keys([1, 2, 3, 4, 6], 2)
    c = chunk_keys([9, 2, 3, 4, 5], 2)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # chunk 0 differs: every key differs
    assert chunk_keys([1, 2], 2, b"model-a") != chunk_keys([1, 2], 2, b"model-b")
