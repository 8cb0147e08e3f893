"""UCX TCP segment sizes: read as UCX reads them, and the check that keeps a reader from READing
a target whose segments it cannot receive (or an agent from starting with sizes UCX refuses);
the memory-type cache off unless the operator chose."""

from __future__ import annotations

import pytest

from kvxferd.transport import ucxenv


def test_unset_sizes_are_ucx_defaults_and_unreadable_ones_unknown():
    assert ucxenv.tcp_segments({}) == ucxenv.UCX_DEFAULT_SEGMENTS
    assert ucxenv.tcp_segments({"UCX_TCP_TX_SEG_SIZE": "auto"}) == (0, 64 << 10)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1m", 1 << 20), ("64K", 64 << 10), ("8kb", 8 << 10), ("8192", 8192), ("2G", 2 << 30),
     (" 4 m ", 4 << 20), ("auto", 0), ("inf", 0), ("1.5m", 0), ("", 0), ("-1k", 0)],
)  # fmt: skip
def test_sizes_read_as_ucx_writes_them(text, size):
    assert ucxenv.parse_size(text) == size


def test_a_target_sending_more_than_its_reader_receives_is_named_from_either_side():
    assert ucxenv.segment_diff(1 << 20, 64 << 10, local="reader") == {
        "tcp_segments": (f"receives {64 << 10} B", f"sends {1 << 20} B")}  # fmt: skip
    assert ucxenv.segment_diff(1 << 20, 64 << 10, local="target") == {
        "tcp_segments": (f"sends {1 << 20} B", f"receives {64 << 10} B")}  # fmt: skip


@pytest.mark.parametrize(("tx", "rx"), [(8 << 10, 64 << 10), (1 << 20, 1 << 20), (0, 1), (1, 0)])
def test_segments_a_reader_can_take_or_sizes_not_known_pass(tx, rx):
    assert ucxenv.segment_diff(tx, rx, local="reader") == {}


def test_an_agent_sending_larger_segments_than_it_receives_is_refused_by_name(monkeypatch):
    from kvxferd.errors import TransportError
    from kvxferd.transport import Agent

    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "1m")
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE", raising=False)
    with pytest.raises(TransportError, match="UCX_TCP_TX_SEG_SIZE .* exceeds UCX_TCP_RX_SEG_SIZE"):
        Agent("never-created")


def test_the_memtype_cache_goes_off_unless_the_operator_chose():
    """A sidecar maps its engine's VRAM through CUDA IPC, which UCX's memory-type cache never
    saw (it calls it host memory and the VRAM registration fails), so serve turns it off."""
    env: dict[str, str] = {}
    assert ucxenv.no_memtype_cache(env) is True
    assert env == {"UCX_MEMTYPE_CACHE": "n"}
    chosen = {"UCX_MEMTYPE_CACHE": "y"}
    assert ucxenv.no_memtype_cache(chosen) is False
    assert chosen == {"UCX_MEMTYPE_CACHE": "y"}
