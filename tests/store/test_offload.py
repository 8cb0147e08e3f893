"""The sidecar's store calls: wire answers and metrics (injected registry) over a real store;
the target is the manifest and region views a registered engine would give. A save's or load's
id lists and token count are bounded as a hold's, before any id is looked at."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from kvxferd import calls
from kvxferd.config import Config
from kvxferd.errors import BlockIdError, ConfigError, HoldExpiredError, StoreError
from kvxferd.metrics import Metrics
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar import offload as offload_mod
from kvxferd.sidecar.offload import Offload
from kvxferd.store import chunk_keys
from kvxferd.wire import (
    HOLD_SPARE_BLOCKS,
    MAX_TOKENS,
    StoreLoadRequest,
    StoreLookupRequest,
    StoreSaveRequest,
)
from kvxferd.wire.store import STORE_SAVE_DEADLINE_S
from tests.store.helpers import DENSE, MAMBA2, block_ids, filled, plan, pool

SEED, CHUNK = 11, 64


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_save_lookup_load_answer_and_count(tmp_path):
    m = plan(MAMBA2, blocks=24)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    target = {"regions": regions}
    metrics = Metrics(CollectorRegistry())
    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK, store_dram_bytes=0)
    off = Offload(cfg, metrics, lambda *_: (m, target["regions"]))
    keys = chunk_keys(list(range(tokens)), CHUNK)

    async def run():
        saved = await off.save(StoreSaveRequest(request_id="r", block_ids=ids, keys=keys,
                                                num_tokens=tokens))  # fmt: skip
        assert saved.chunks_saved > 0 and saved.dram_bytes == 0 and saved.file_bytes > 0
        hit = await off.lookup(StoreLookupRequest(keys=keys, num_tokens=tokens))
        assert hit.matched == tokens
        miss = await off.lookup(StoreLookupRequest(keys=chunk_keys([3] * 10, CHUNK), num_tokens=10))
        assert miss.matched == 0
        target["regions"] = pool(m)
        dst = block_ids(m, tokens)
        done = await off.load(StoreLoadRequest(keys=keys, block_ids=dst, num_tokens=tokens))
        assert done.state == "done" and done.dram_hit_rate == 0.0 and done.file_bytes > 0
        assert verify_pattern(m, target["regions"], dst, SEED) is None
        for f in tmp_path.rglob("*.kvx"):
            f.write_bytes(f.read_bytes()[:-1])
            break
        failed = await off.load(StoreLoadRequest(keys=keys, block_ids=dst, num_tokens=tokens))
        assert failed.state == "failed" and failed.reason == "store_corrupt"

    asyncio.run(run())
    off.close()
    assert _value(metrics, "kvxferd_store_lookup_tokens_total", result="hit") == tokens
    assert _value(metrics, "kvxferd_store_lookup_tokens_total", result="miss") == 10
    assert _value(metrics, "kvxferd_store_bytes_total", tier="file", op="save") > 0
    assert _value(metrics, "kvxferd_store_bytes_total", tier="file", op="load") > 0
    assert _value(metrics, "kvxferd_store_loads_total", outcome="done") == 1
    assert _value(metrics, "kvxferd_store_loads_total", outcome="failed") == 1
    assert _value(metrics, "kvxferd_store_corrupt_entries_total", tier="file") == 1
    assert _value(metrics, "kvxferd_store_resident_bytes", tier="file") > 0


def test_without_a_store_dir_every_call_names_the_setting():
    off = Offload(Config(), Metrics(CollectorRegistry()), lambda *_: pytest.fail("not reached"))
    with pytest.raises(StoreError) as err:
        asyncio.run(off.lookup(StoreLookupRequest(keys=[], num_tokens=0)))
    assert err.value.field == "store_dir"


def test_unusable_store_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="store_dir"):
        Offload(
            Config(store_dir=str(blocker / "sub")), Metrics(CollectorRegistry()), lambda *_: None
        )


def test_a_hybrid_hold_saves_all_its_tokens_or_nothing(tmp_path):
    """The hold's Mamba state is the state after its last token: a save of a shorter prefix
    would store it under that prefix's key, and a later hit would load the wrong state."""
    m = plan(MAMBA2, blocks=24)
    held, prefix = 400, 128
    regions, ids = filled(m, held, SEED)
    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions),
                  lambda _h, _r: (ids, held, lambda: None))  # fmt: skip
    keys = chunk_keys(list(range(prefix)), CHUNK)
    with pytest.raises(StoreError) as err:
        asyncio.run(off.save(StoreSaveRequest(request_id="r", keys=keys, hold_id="h",
                                              num_tokens=prefix)))  # fmt: skip
    assert err.value.field == "num_tokens"
    lookup = asyncio.run(off.lookup(StoreLookupRequest(keys=keys, num_tokens=prefix)))
    assert lookup.matched == 0
    off.close()


def test_a_save_from_a_hold_let_go_during_its_copy_keeps_no_entry_copied_after(tmp_path):
    """The engine may reuse a hold's blocks once the hold is released: an entry whose copy ended
    after that may hold other bytes, so it is not stored, and the save fails. Entries copied
    while the hold still pinned the blocks are kept."""
    m = plan(DENSE, blocks=24)
    held = 4 * CHUNK
    regions, ids = filled(m, held, SEED)
    checks: list[int] = []

    def pinned() -> None:  # the hold is released while the second entry is copied
        checks.append(1)
        if len(checks) >= 2:
            raise HoldExpiredError("hold h: let go (aborted); its blocks may be reused")

    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions),
                  lambda _h, _r: (ids, held, pinned))  # fmt: skip
    keys = chunk_keys(list(range(held)), CHUNK)
    with pytest.raises(HoldExpiredError):
        asyncio.run(off.save(StoreSaveRequest(request_id="r", keys=keys, hold_id="h")))
    lookup = asyncio.run(off.lookup(StoreLookupRequest(keys=keys, num_tokens=held)))
    assert lookup.matched == CHUNK and len(checks) == 2  # the first entry only
    off.close()


def test_a_save_or_load_listing_more_ids_than_its_tokens_span_is_refused_before_any_id(tmp_path):
    """Each group lists at most the blocks the tokens span plus HOLD_SPARE_BLOCKS (a hold's
    rule), checked before any id is: the id past the limit, out of range, is never reached."""
    m = plan(DENSE, blocks=8)
    tokens = 2 * m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions))
    keys = chunk_keys(list(range(tokens)), CHUNK)
    most = 2 + HOLD_SPARE_BLOCKS
    flood = [ids[0] + [-1] * (most - len(ids[0])) + [m.num_blocks]]  # one id too many
    calls = (
        lambda ids, n: off.save(StoreSaveRequest(request_id="r", block_ids=ids, keys=keys,
                                                 num_tokens=n)),
        lambda ids, n: off.load(StoreLoadRequest(keys=keys, block_ids=ids, num_tokens=n)),
    )  # fmt: skip
    for call in calls:
        with pytest.raises(BlockIdError) as err:
            asyncio.run(call(flood, tokens))
        assert err.value.field == "block_ids[0]" and f"need at most {most}" in str(err.value)
        with pytest.raises(StoreError) as err:
            asyncio.run(call(ids, MAX_TOKENS + 1))
        assert err.value.field == "num_tokens"
    saved = asyncio.run(calls[0]([flood[0][:most]], tokens))  # as many as allowed: taken
    assert saved.chunks_saved > 0
    assert asyncio.run(calls[1]([flood[0][:most]], tokens)).state == "done"
    off.close()


def test_a_lookup_past_max_tokens_is_refused_naming_num_tokens(tmp_path):
    m = plan(DENSE, blocks=8)
    regions, _ids = filled(m, m.groups[0].block_size, SEED)
    chunk = 1 << 20
    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=chunk)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions))
    for num_tokens in (MAX_TOKENS + 1, -1):
        with pytest.raises(StoreError) as err:
            asyncio.run(off.lookup(StoreLookupRequest(keys=[], num_tokens=num_tokens)))
        assert err.value.field == "num_tokens"
    keys = [f"{c:032x}" for c in range(MAX_TOKENS // chunk)]  # the most tokens: looked up
    lookup = asyncio.run(off.lookup(StoreLookupRequest(keys=keys, num_tokens=MAX_TOKENS)))
    assert lookup.matched == 0
    off.close()


def test_a_save_copies_nothing_once_its_client_may_have_given_up(tmp_path, monkeypatch):
    """A client gives up on a save STORE_SAVE_DEADLINE_S + a margin after sending it, and the
    engine then frees and reuses the blocks: an entry copied after that would keep another
    request's bytes under this one's keys. The save stops copying at its deadline and answers
    what it stored; every stored byte is the request's."""
    monkeypatch.setattr(offload_mod, "STORE_SAVE_DEADLINE_S", 1.0)
    m = plan(DENSE, blocks=24)
    tokens = 2 * CHUNK
    regions, ids = filled(m, tokens, SEED)
    target, calls = {"regions": regions}, []

    def slow_then_reused() -> None:  # before each entry's copy
        calls.append(time.monotonic())
        if len(calls) == 2:  # a disk slow enough to outlast the client, then the reuse
            while time.monotonic() - calls[0] <= 1.0:
                pass
            write_pattern(m, regions, ids, SEED + 1)

    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, target["regions"]),
                  guard=slow_then_reused)  # fmt: skip
    keys = chunk_keys(list(range(tokens)), CHUNK)
    saved = asyncio.run(off.save(StoreSaveRequest(request_id="r", keys=keys, block_ids=ids,
                                                  num_tokens=tokens)))  # fmt: skip
    hit = asyncio.run(off.lookup(StoreLookupRequest(keys=keys, num_tokens=tokens)))
    assert hit.matched < tokens and saved.chunks_saved == hit.matched // CHUNK
    dst = block_ids(m, hit.matched)
    target["regions"] = back = pool(m)
    if hit.matched:
        load = StoreLoadRequest(keys=keys[: hit.matched // CHUNK], block_ids=dst,
                                num_tokens=hit.matched)  # fmt: skip
        assert asyncio.run(off.load(load)).state == "done"
        assert verify_pattern(m, back, dst, SEED) is None
    off.close()


def test_a_client_waits_for_a_save_past_the_sidecars_save_deadline():
    """What makes the deadline above safe: the engine frees the blocks only after its wait, and
    tells the sidecar to stop by then, however late the call comes."""
    req = StoreSaveRequest(request_id="r", keys=[], block_ids=[], num_tokens=0)
    t0 = time.monotonic_ns()
    call = calls.store_save(req)
    assert call.timeout_s > STORE_SAVE_DEADLINE_S + 1.0
    assert call.body.not_after_ns <= time.monotonic_ns() + STORE_SAVE_DEADLINE_S * 1e9
    assert call.body.not_after_ns >= t0 + STORE_SAVE_DEADLINE_S * 1e9


def test_an_unregister_stops_a_save_before_its_next_copy(tmp_path):
    """Offload.stop (unregister, shutdown) ends a save as it ends a load: at its next entry, not
    up to its deadline later (an unregister answered 503 meanwhile; a shutdown unmapped the
    regions under the copy after STOP_S)."""
    m = plan(DENSE, blocks=24)
    tokens = 4 * CHUNK
    regions, ids = filled(m, tokens, SEED)
    copying, proceed, calls = threading.Event(), threading.Event(), []

    def second_copy_waits() -> None:  # before each entry's copy
        calls.append(1)
        if len(calls) == 2:
            copying.set()
            assert proceed.wait(30)

    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions),
                  guard=second_copy_waits)  # fmt: skip
    keys = chunk_keys(list(range(tokens)), CHUNK)

    async def run() -> tuple[int, int]:
        save = asyncio.ensure_future(off.save(StoreSaveRequest(
            request_id="r", keys=keys, block_ids=ids, num_tokens=tokens)))  # fmt: skip
        assert await asyncio.to_thread(copying.wait, 30)
        stopping = asyncio.ensure_future(off.stop(timeout_s=30))
        # Scheduled after the stop's first step (FIFO), which sets every call's event.
        asyncio.get_running_loop().call_soon(proceed.set)
        return (await save).chunks_saved, await stopping

    saved, still_running = asyncio.run(run())
    assert still_running == 0 and saved == 1 and len(calls) == 2
    hit = asyncio.run(off.lookup(StoreLookupRequest(keys=keys, num_tokens=tokens)))
    assert hit.matched == CHUNK
    off.close()


def test_a_hybrid_save_without_a_state_block_answers_the_state_skipped(tmp_path):
    """A Mamba group whose state block is -1 saves no state: the attention chunks are saved,
    the state is counted skipped (it was not counted at all)."""
    m = plan(MAMBA2, blocks=24)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    mamba = [g for g, group in enumerate(m.groups) if group.kind == "mamba"]
    ids[mamba[0]] = [-1]
    cfg = Config(store_dir=str(tmp_path), store_chunk_tokens=CHUNK)
    off = Offload(cfg, Metrics(CollectorRegistry()), lambda *_: (m, regions))
    keys = chunk_keys(list(range(tokens)), CHUNK)
    saved = asyncio.run(off.save(StoreSaveRequest(request_id="r", block_ids=ids, keys=keys,
                                                  num_tokens=tokens)))  # fmt: skip
    attention = len(m.groups) - len(mamba)
    assert saved.chunks_skipped == 1
    assert saved.chunks_saved == attention * len(keys) + len(mamba) - 1
    off.close()
