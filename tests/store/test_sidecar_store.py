"""The store through a real sidecar's engine API: save from one sidecar, restart, look up and load
into other blocks from a new sidecar (new process, empty DRAM pool), every byte verified; an
over-long id list or token count is a 422 naming it, and the sidecar serves on."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.errors import BlockIdError, StoreError, UnknownHoldError
from kvxferd.layout import request_blocks
from kvxferd.pattern import (
    verify_pattern,
    verify_token_pattern,
    write_pattern,
    write_token_pattern,
)
from kvxferd.store import chunk_keys
from kvxferd.wire import (
    HOLD_SPARE_BLOCKS,
    MAX_TOKENS,
    HoldRequest,
    StoreLoadRequest,
    StoreLookupRequest,
    StoreSaveRequest,
)
from tests.sidecar.harness import SENTINEL, EnginePool, plan, start_sidecar
from tests.store.helpers import DENSE, GDN, MAMBA2, block_ids, poisoned

pytestmark = pytest.mark.nixl
SEED, CHUNK = 5, 64


def _metrics(sidecar) -> dict:  # noqa: ANN001
    text = httpx.get(f"http://{sidecar.peer}/metrics", follow_redirects=True, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.mark.parametrize("preset", [DENSE, MAMBA2, GDN])
def test_save_restart_lookup_load_verifies_every_byte(tmp_path, preset):
    store_dir = str(tmp_path / "store")
    flags = ("--store-dir", store_dir, "--store-chunk-tokens", str(CHUNK))
    probe = plan(preset, num_blocks=1)
    tokens = 2 * probe.groups[-1].block_size + 5  # ends inside a block
    manifest = plan(preset, num_blocks=sum(request_blocks(probe, tokens)) + 2)
    prompt = list(range(tokens))
    keys = chunk_keys(prompt, CHUNK)
    src_ids = block_ids(manifest, tokens, descending=True)
    pool = EnginePool(manifest)
    try:
        write_pattern(manifest, pool.views, src_ids, SEED)
        first = start_sidecar(str(tmp_path), "saver", *flags)
        try:
            with first.client() as client:
                client.register(manifest, pool.specs())
                saved = client.store_save(
                    StoreSaveRequest(
                        request_id="r1", block_ids=src_ids, keys=keys, num_tokens=tokens
                    )  # fmt: skip
                )
                assert saved.chunks_saved > 0 and saved.kv_bytes > 0
                assert (saved.state_bytes > 0) == (preset != DENSE)
        finally:
            assert first.stop() == 0
        second = start_sidecar(str(tmp_path), "loader", *flags)
        try:
            with second.client() as client:
                client.register(manifest, pool.specs())
                hit = client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=tokens))
                assert hit.matched == tokens and not hit.disagree
                scratch, dst_ids = poisoned(manifest, tokens, SEED)  # the load must write these
                for view, want in zip(pool.views, scratch, strict=True):
                    view[:] = want
                assert verify_pattern(manifest, pool.views, dst_ids, SEED) is not None
                status = client.store_load(
                    StoreLoadRequest(keys=keys, block_ids=dst_ids, num_tokens=tokens)
                )
                assert status.state == "done" and status.tokens == tokens
                assert status.file_bytes > 0 and status.dram_hit_rate == 0.0
                assert verify_pattern(manifest, pool.views, dst_ids, SEED) is None
                again = client.store_load(
                    StoreLoadRequest(keys=keys, block_ids=dst_ids, num_tokens=tokens)
                )
                assert again.dram_hit_rate == 1.0
                missing = client.store_load(
                    StoreLoadRequest(
                        keys=chunk_keys([7] * tokens, CHUNK), block_ids=dst_ids, num_tokens=tokens
                    )  # fmt: skip
                )
                assert missing.state == "failed" and missing.reason == "store_miss"
                with pytest.raises(BlockIdError) as err:
                    client.store_load(StoreLoadRequest(keys=keys, block_ids=[[999]],
                                                       num_tokens=tokens))  # fmt: skip
                assert err.value.field.startswith("block_ids")
                with pytest.raises(StoreError) as bad:
                    client.store_lookup(
                        StoreLookupRequest(keys=[*keys, keys[0]], num_tokens=tokens)
                    )
                assert bad.value.field == "keys"
                for deadline in (0.0, -1.0, 1e9):
                    req = StoreLoadRequest(keys=keys, block_ids=dst_ids, num_tokens=tokens,
                                           deadline_s=deadline)  # fmt: skip
                    with pytest.raises(StoreError) as late:
                        client.store_load(req)
                    assert late.value.field == "deadline_s"
            values = _metrics(second)
            assert values[("kvxferd_store_lookup_tokens_total", (("result", "hit"),))] == tokens
            assert values[("kvxferd_store_loads_total", (("outcome", "done"),))] == 2
            assert values[("kvxferd_store_loads_total", (("outcome", "failed"),))] == 1
            assert values[("kvxferd_store_bytes_total", (("op", "load"), ("tier", "file")))] > 0
        finally:
            assert second.stop() == 0
    finally:
        pool.close()


def test_a_sidecar_without_a_store_says_so(tmp_path):
    manifest = plan("llama-3.1-8b", num_blocks=4)
    pool = EnginePool(manifest)
    sidecar = start_sidecar(str(tmp_path), "nostore")
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            with pytest.raises(StoreError) as err:
                client.store_lookup(StoreLookupRequest(keys=[], num_tokens=0))
            assert err.value.field == "store_dir"
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_save_a_live_hold_by_its_id(tmp_path):
    """The prefill engine holds its blocks for a decode and saves the same hold to the store."""
    manifest = plan(DENSE, num_blocks=8)
    tokens = 40
    keys = chunk_keys(list(range(tokens)), 16)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens, descending=True)
    write_pattern(manifest, pool.views, ids, SEED)
    sidecar = start_sidecar(str(tmp_path), "holder", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", "16")  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            ticket = client.hold(HoldRequest(request_id="r", block_ids=ids, num_tokens=tokens))
            saved = client.store_save(
                StoreSaveRequest(request_id="r", keys=keys, hold_id=ticket.hold_id)
            )
            assert saved.chunks_saved == 3 and saved.kv_bytes > 0
            assert (
                client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=tokens)).matched == 40
            )
            scratch, dst = poisoned(manifest, tokens, SEED)
            for view, want in zip(pool.views, scratch, strict=True):
                view[:] = want
            done = client.store_load(StoreLoadRequest(keys=keys, block_ids=dst, num_tokens=tokens))
            assert done.state == "done" and done.dram_hit_rate == 1.0
            assert verify_pattern(manifest, pool.views, dst, SEED) is None
            with pytest.raises(UnknownHoldError):
                client.store_save(StoreSaveRequest(request_id="r", keys=keys, hold_id="nope"))
            with pytest.raises(StoreError) as both:
                client.store_save(StoreSaveRequest(request_id="r", keys=keys, block_ids=ids,
                                                   hold_id=ticket.hold_id))  # fmt: skip
            assert both.value.field == "block_ids"
    finally:
        assert sidecar.stop() == 0
        pool.close()


def _save_and_load(client, keys: list[str], tokens: int) -> tuple[Callable, Callable]:
    """A save and a load of ``keys`` over the block ids they are given (a bounds test feeds
    both the same lists)."""
    return (
        lambda i: client.store_save(StoreSaveRequest(request_id="r", keys=keys, block_ids=i,
                                                     num_tokens=tokens)),
        lambda i: client.store_load(StoreLoadRequest(keys=keys, block_ids=i, num_tokens=tokens)),
    )  # fmt: skip


def test_a_store_call_past_its_bounds_is_a_422_naming_the_field_and_the_sidecar_serves_on(tmp_path):
    """More ids than a save's or load's tokens span, a lookup of more than MAX_TOKENS tokens."""
    manifest = plan(DENSE, num_blocks=8)
    tokens = 16
    keys = chunk_keys(list(range(tokens)), 16)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    flood = [[-1] * (-(-tokens // manifest.groups[0].block_size) + HOLD_SPARE_BLOCKS + 1)]
    sidecar = start_sidecar(str(tmp_path), "flooded", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", "16")  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            for call in _save_and_load(client, keys, tokens):
                with pytest.raises(BlockIdError) as err:
                    call(flood)
                assert (err.value.status, err.value.field) == (422, "block_ids[0]")
                call(ids)  # served as ever
            with pytest.raises(StoreError) as err:
                client.store_lookup(StoreLookupRequest(keys=[], num_tokens=MAX_TOKENS + 1))
            assert (err.value.status, err.value.field) == (422, "num_tokens")
            assert client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=tokens)).matched
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_save_of_a_holds_prefix_takes_a_sliding_windows_blocks_at_their_own_tokens(tmp_path):
    """A hold's sliding-window list holds its last blocks (those of the hold's own tokens): a
    save of a shorter prefix by the hold's id must read each block at the tokens it holds, not
    at the prefix's last ones, else the prefix's window entries hold other tokens' KV."""
    sw_preset, held, prefix, chunk = "gpt-oss-20b", 320, 288, 32  # window 128, blocks of 16
    manifest = plan(sw_preset, num_blocks=48)
    sw = next(g for g, grp in enumerate(manifest.groups) if grp.kind == "sliding_window")
    bs = manifest.groups[sw].block_size
    placed = block_ids(manifest, held, descending=True)  # as an engine places them
    assert len(placed[sw]) == 10  # the window group keeps its last 10 blocks (tokens 160..319)
    anchored = [list(g) for g in placed]
    anchored[sw] = [-1] * (held // bs - 10) + placed[sw]  # full length: each at its own tokens
    pool = EnginePool(manifest)
    sidecar = start_sidecar(str(tmp_path), "swhold", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", str(chunk))  # fmt: skip
    try:
        for n in (held, prefix):  # the window rows of both (160..319) hold the token pattern
            write_token_pattern(manifest, pool.views, anchored, n, SEED)
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            ticket = client.hold(HoldRequest(request_id="r", block_ids=placed, num_tokens=held))
            keys = chunk_keys(list(range(prefix)), chunk)
            client.store_save(StoreSaveRequest(request_id="r", keys=keys, hold_id=ticket.hold_id,
                                               num_tokens=prefix))  # fmt: skip
            hit = client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=prefix))
            assert hit.matched == prefix  # the prefix's window (160..287) is in the hold
            for view in pool.views:
                view[:] = SENTINEL
            dst = block_ids(manifest, prefix)  # other blocks than the hold's
            assert verify_token_pattern(manifest, pool.views, dst, prefix, SEED) is not None
            done = client.store_load(StoreLoadRequest(keys=keys, block_ids=dst, num_tokens=prefix))
            assert done.state == "done"
            assert verify_token_pattern(manifest, pool.views, dst, prefix, SEED) is None
    finally:
        assert sidecar.stop() == 0
        pool.close()


@pytest.mark.parametrize(
    ("bad", "why"), [(1 << 63, "outside"), ((1 << 64) - 1, "outside"), ("repeat", "repeats")]
)
def test_a_store_id_past_int64_or_repeated_is_a_422_naming_it_and_nothing_is_stored(
    tmp_path, bad, why
):
    """msgpack carries ids up to 2**64-1 (they were a 500); a repeated id would save one block
    under two chunks' keys, or load two chunks into one block (they were done, 200)."""
    manifest = plan(DENSE, num_blocks=8)
    tokens = 2 * manifest.groups[0].block_size
    keys = chunk_keys(list(range(tokens)), 16)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    wrong = [[ids[0][0], ids[0][0] if bad == "repeat" else bad, *ids[0][2:]], *ids[1:]]
    sidecar = start_sidecar(str(tmp_path), "edges", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", "16")  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            for call in _save_and_load(client, keys, tokens):
                with pytest.raises(BlockIdError) as err:
                    call(wrong)
                assert (err.value.status, err.value.field) == (422, "block_ids[0][1]")
                assert why in str(err.value)
            hit = client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=tokens))
            assert hit.matched == 0  # the refused save stored nothing
            assert client.store_save(StoreSaveRequest(request_id="r", keys=keys, block_ids=ids,
                                                      num_tokens=tokens)).chunks_saved  # fmt: skip
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_store_call_repeating_a_key_is_a_422_naming_that_key_and_nothing_is_stored(tmp_path):
    """Keys chain the whole prefix, so one prompt never repeats a key: a save that did stored the
    state after chunk 2 under chunk 0's key (a later one-chunk prompt matched it and its load
    failed store_corrupt, deleting it); a lookup or load that did would read it for chunk 2."""
    manifest = plan(MAMBA2, num_blocks=16)
    tokens = 3 * CHUNK
    keys = chunk_keys(list(range(tokens)), CHUNK)
    repeated = [keys[0], keys[1], keys[0]]
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    write_pattern(manifest, pool.views, ids, SEED)
    sidecar = start_sidecar(str(tmp_path), "repeats", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", str(CHUNK))  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            calls = (
                lambda: client.store_save(StoreSaveRequest(request_id="r", keys=repeated,
                                                           block_ids=ids, num_tokens=tokens)),
                lambda: client.store_lookup(StoreLookupRequest(keys=repeated, num_tokens=tokens)),
                lambda: client.store_load(StoreLoadRequest(keys=repeated, block_ids=ids,
                                                           num_tokens=tokens)),
            )  # fmt: skip
            for call in calls:
                with pytest.raises(StoreError) as err:
                    call()
                assert (err.value.status, err.value.field) == (422, "keys[2]")
                assert "repeats keys[0]" in str(err.value)
            for n in (CHUNK, tokens):  # the refused save stored nothing
                hit = client.store_lookup(StoreLookupRequest(keys=keys[: n // CHUNK], num_tokens=n))
                assert hit.matched == 0 and not any(hit.matched_tokens)
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_save_whose_full_attention_list_is_short_of_its_tokens_is_a_422_naming_the_list(
    tmp_path,
):
    """A full-attention group lists a block for every block its tokens span (-1 for one not to
    save): a short list was read as the request's last blocks and saved nothing, answered 200."""
    manifest = plan(DENSE, num_blocks=8)
    tokens = 3 * manifest.groups[0].block_size
    keys = chunk_keys(list(range(tokens)), 16)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    sidecar = start_sidecar(str(tmp_path), "short", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", "16")  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            for short in ([ids[0][:-1]], [[]]):
                req = StoreSaveRequest(request_id="r", keys=keys, block_ids=short,
                                       num_tokens=tokens)  # fmt: skip
                with pytest.raises(BlockIdError) as err:
                    client.store_save(req)
                assert (err.value.status, err.value.field) == (422, "block_ids[0]")
                assert f"span {len(ids[0])}" in str(err.value)
            hit = client.store_lookup(StoreLookupRequest(keys=keys, num_tokens=tokens))
            assert hit.matched == 0
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_partial_save_answers_the_entries_it_skipped_for_want_of_blocks(tmp_path):
    """A sliding window's blocks that left it (its short list holds the last ones) and a
    full-attention group's chunks from a -1 on are not saved: the answer counts them, so saved,
    present and skipped add up to every entry of the tokens."""
    sw_preset, tokens, chunk = "gpt-oss-20b", 320, 32  # window 128 in blocks of 16: 10 blocks
    manifest = plan(sw_preset, num_blocks=48)
    fa = next(g for g, grp in enumerate(manifest.groups) if grp.kind == "full_attention")
    keys = chunk_keys(list(range(tokens)), chunk)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    write_pattern(manifest, pool.views, ids, SEED)
    ids[fa][12] = -1  # tokens 192..207: chunks 6..9 of that group are not saved
    sidecar = start_sidecar(str(tmp_path), "partial", "--store-dir", str(tmp_path / "s"),
                            "--store-chunk-tokens", str(chunk))  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            save = StoreSaveRequest(request_id="r", keys=keys, block_ids=ids, num_tokens=tokens)
            saved = client.store_save(save)
            # full attention: chunks 0..5 saved, 6..9 skipped; the window: 5..9 saved, 0..4 not
            assert (saved.chunks_saved, saved.chunks_skipped) == (6 + 5, 4 + 5)
            again = client.store_save(save)
            assert (again.chunks_saved, again.chunks_present, again.chunks_skipped) == (0, 11, 9)
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_sidecar_keeps_at_most_store_file_entries_files_evicting_the_least_recent(tmp_path):
    """Three one-chunk prompts under --store-file-entries 2 (DRAM off): the first is evicted,
    the other two are served, the last loads byte-exact; the eviction is counted."""
    manifest = plan(DENSE, num_blocks=8)
    tokens = manifest.groups[0].block_size
    prompts = [chunk_keys([p] * tokens, tokens) for p in (1, 2, 3)]
    pool = EnginePool(manifest)
    ids = block_ids(manifest, tokens)
    write_pattern(manifest, pool.views, ids, SEED)
    store_dir = tmp_path / "s"
    sidecar = start_sidecar(str(tmp_path), "entries", "--store-dir", str(store_dir),
                            "--store-chunk-tokens", str(tokens), "--store-dram-bytes", "0",
                            "--store-file-entries", "2")  # fmt: skip
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            for keys in prompts:
                save = StoreSaveRequest(request_id="r", keys=keys, block_ids=ids,
                                        num_tokens=tokens)  # fmt: skip
                assert client.store_save(save).chunks_saved == 1
            assert len(list(store_dir.rglob("*.kvx"))) == 2
            hits = [client.store_lookup(StoreLookupRequest(keys=k, num_tokens=tokens)).matched
                    for k in prompts]  # fmt: skip
            assert hits == [0, tokens, tokens]
            scratch, dst = poisoned(manifest, tokens, SEED)
            for view, want in zip(pool.views, scratch, strict=True):
                view[:] = want
            done = client.store_load(StoreLoadRequest(keys=prompts[2], block_ids=dst,
                                                      num_tokens=tokens))  # fmt: skip
            assert done.state == "done" and done.file_bytes > 0
            assert verify_pattern(manifest, pool.views, dst, SEED) is None
        values = _metrics(sidecar)
        assert values[("kvxferd_store_evictions_total", (("tier", "file"),))] == 1
    finally:
        assert sidecar.stop() == 0
        pool.close()
