"""UCX's protocol log read back: which transports READs and notifications use."""

from __future__ import annotations

import os

import pytest

from kvxferd.transport.fabric import ProtoLog, enable, kind

# Trimmed from a real UCX_PROTO_INFO=y log of a loopback READ (UCX 1.23, cma available).
LOG = """\
[1795398644.93] [vm:8697 :1]   +--------+-------------+-------------------------------------------+
[1795398644.93] [vm:8697 :1]   | kvx-1a2b-17954 intra-node cfg#1                                   |
[1795398644.93] [vm:8697 :1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795398644.93] [vm:8697 :1]   +--------+-------------+-------------------------------------------+
[1795398644.93] [vm:8697 :1]   | Range  | Description |                  Config                   |
[1795398644.93] [vm:8697 :1]   +--------+-------------+-------------------------------------------+
[1795398644.93] [vm:8697 :1]   | 0..inf | zero-copy   | cma/memory                                |
[1795398644.93] [vm:8697 :1]   +--------+-------------+-------------------------------------------+
[1795398644.95] [vm:8697 :0]   +------------+--------------------+---------------+
[1795398644.95] [vm:8697 :0]   | ac52854 self cfg#0                              |
[1795398644.95] [vm:8697 :0]   | active message by ucp_am_send* from host memory |
[1795398644.95] [vm:8697 :0]   +------------+--------------------+---------------+
[1795398644.95] [vm:8697 :0]   |   Range    |    Description     |    Config     |
[1795398644.95] [vm:8697 :0]   +------------+--------------------+---------------+
[1795398644.95] [vm:8697 :0]   |          0 | short              | tcp/lo        |
[1795398644.95] [vm:8697 :0]   |   1..16515 | zero-copy          | tcp/lo        |
[1795398644.95] [vm:8697 :0]   +------------+--------------------+---------------+
"""

# The same format for an RDMA peer on another host (constructed: no RDMA NIC on these machines).
INTER = """\
[1.0] [h:1 :2]   | 1a2b3c4 inter-node cfg#2                                        |
[1.0] [h:1 :2]   | remote memory read by ucp_get* into host memory from host |
[1.0] [h:1 :2]   +--------+-------------+------------------------------------------------+
[1.0] [h:1 :2]   | Range  | Description |                  Config                        |
[1.0] [h:1 :2]   | 0..inf | zero-copy   | rc_mlx5/mlx5_0:1 50% on rc_mlx5/mlx5_1:1 50%   |
[1.0] [h:1 :2]   +--------+-------------+------------------------------------------------+
"""


@pytest.mark.parametrize(
    ("transport", "want"),
    [("rc_mlx5/mlx5_0:1", "rdma"), ("ud_verbs", "rdma"), ("dc_mlx5", "rdma"),
     ("tcp/lo", "tcp"), ("cma/memory", "cma"), ("cuda_ipc/cuda", "cuda_ipc"),
     ("sysv/memory", "shm"), ("self/memory", "self")],
)  # fmt: skip
def test_transport_kinds(transport, want):
    assert kind(transport) == want


def test_reads_and_messages_are_told_apart_by_endpoint(tmp_path):
    path = tmp_path / "ucx.log"
    path.write_text(LOG)
    lanes = ProtoLog(path).scan()
    assert lanes.reads == {"intra-node": {"cma/memory"}}
    assert lanes.messages == {"self": {"tcp/lo"}}
    assert lanes.read_kinds() == {"cma"}


def test_the_log_is_followed_as_it_grows_and_multi_rail_lanes_all_count(tmp_path):
    path = tmp_path / "ucx.log"
    log = ProtoLog(path)
    assert log.scan().reads == {}  # no file yet
    half = len(LOG) // 2
    path.write_text(LOG[:half])
    log.scan()
    with path.open("a") as fh:
        fh.write(LOG[half:] + INTER)
    lanes = log.scan()
    assert lanes.reads["intra-node"] == {"cma/memory"}
    assert lanes.reads["inter-node"] == {"rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"}
    assert lanes.read_kinds() == {"cma", "rdma"}


def test_enable_leaves_an_operators_ucx_logging_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_LOG_FILE", "/somewhere/else.log")
    assert enable(tmp_path / "x.log") is None
    monkeypatch.delenv("UCX_LOG_FILE")
    monkeypatch.delenv("UCX_PROTO_INFO", raising=False)
    assert enable(tmp_path / "x.log") == tmp_path / "x.log"
    assert os.environ["UCX_PROTO_INFO"] == "y"
    assert os.environ["UCX_LOG_FILE"] == str(tmp_path / "x.log")


def test_a_sidecar_knows_when_reads_go_over_tcp_and_rechecks_the_log(tmp_path):
    from kvxferd.sidecar.fabric import TCP_RECHECK_S, Fabric

    path = tmp_path / "proto.log"
    path.write_text(LOG)  # a cma READ; tcp only for messages
    fabric = Fabric("any", str(path))
    try:
        assert fabric.reads_over_tcp(now=100.0) is False
        with path.open("a") as fh:
            fh.write(LOG.replace("cma/memory", "tcp/lo").replace("cfg#1", "cfg#3"))
        assert fabric.reads_over_tcp(now=100.0 + TCP_RECHECK_S / 2) is False  # not rescanned
        assert fabric.reads_over_tcp(now=100.0 + TCP_RECHECK_S) is True
    finally:
        fabric.close()


def test_a_protocol_log_that_cannot_be_read_keeps_the_last_answer(tmp_path):
    from kvxferd.sidecar.fabric import TCP_RECHECK_S, Fabric

    path = tmp_path / "proto.log"
    path.write_text(LOG.replace("cma/memory", "tcp/lo"))
    fabric = Fabric("any", str(path))
    try:
        assert fabric.reads_over_tcp(now=100.0) is True
        path.unlink()
        path.mkdir()  # reading it now raises IsADirectoryError, not FileNotFoundError
        assert fabric.reads_over_tcp(now=100.0 + TCP_RECHECK_S) is True  # and pulls go on
    finally:
        if path.is_dir():
            path.rmdir()
        fabric.close()


def test_closing_leaves_a_protocol_log_path_it_cannot_remove_and_does_not_raise(tmp_path, caplog):
    from kvxferd.sidecar.fabric import Fabric

    path = tmp_path / "proto.log"
    fabric = Fabric("any", str(path))
    path.mkdir()  # not a file any more: unlink raises IsADirectoryError (or PermissionError)
    with caplog.at_level("WARNING", logger="kvxferd.sidecar.fabric"):
        fabric.close()
    assert path.is_dir()
    assert "could not remove the UCX protocol log" in caplog.text
