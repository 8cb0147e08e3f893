"""Config: defaults < KVXFERD_* environment < flags; bad values name the variable or field."""

from __future__ import annotations

import dataclasses

import pytest

from kvxferd.config import ENV_PREFIX, Config, env_help, load_config, replace
from kvxferd.errors import ConfigError


def test_defaults_without_environment():
    config = load_config(env={})
    assert config == Config()
    assert (config.peer_port, config.backends, config.progress_thread) == (0, ("UCX",), False)
    assert config.peer_token == "" and config.advertised_host == config.peer_host


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("PEER_PORT", "5557", "peer_port", 5557),
        ("DEFAULT_LEASE_S", "2.5", "default_lease_s", 2.5),
        ("PROGRESS_THREAD", "off", "progress_thread", False),
        ("PROGRESS_THREAD", "YES", "progress_thread", True),
        ("PROGRESS_THREAD", "0", "progress_thread", False),
        ("BACKENDS", "UCX, GDS ,", "backends", ("UCX", "GDS")),
        ("PEER_TOKEN", "s3cret", "peer_token", "s3cret"),
        ("ENGINE_SOCKET", "/run/k.sock", "engine_socket", "/run/k.sock"),
        ("EVENT_LOOP", "asyncio", "event_loop", "asyncio"),
        ("HTTP", "h11", "http", "h11"),
    ],
)
def test_environment_values_are_parsed_to_the_field_type(var, raw, field, value):
    config = load_config(env={ENV_PREFIX + var: raw})
    assert getattr(config, field) == value
    assert type(getattr(config, field)) is type(value)


def test_an_empty_environment_value_means_the_default():
    assert load_config(env={"KVXFERD_PEER_PORT": ""}).peer_port == Config().peer_port


def test_flags_override_the_environment_and_none_flags_do_not():
    env = {"KVXFERD_PEER_PORT": "5557", "KVXFERD_LOG_LEVEL": "debug"}
    config = load_config({"peer_port": 6000, "log_level": None}, env=env)
    assert (config.peer_port, config.log_level) == (6000, "debug")


def test_advertise_host_wins_over_the_bind_host_when_set():
    config = load_config({"peer_host": "0.0.0.0", "advertise_host": "10.0.0.7"}, env={})
    assert config.advertised_host == "10.0.0.7"


@pytest.mark.parametrize("host", ["::1", "[::1]", "fe80::1%eth0", "kv-0.kv.svc.cluster.local"])
def test_an_advertised_host_is_a_name_or_ip_address(host):
    assert load_config({"advertise_host": host}, env={}).advertised_host == host


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"advertise_host": "a b"}, "advertise_host"), ({"advertise_host": "h" * 256},
     "advertise_host"), ({"peer_host": "h\r\nX: y"}, "peer_host")],
    ids=["space", "256", "crlf-in-the-bind-host"],
)  # fmt: skip
def test_an_advertised_host_a_ticket_could_not_carry_is_refused_at_start(overrides, named):
    """Tickets carry it as their peer, which a decode side refuses unless host:port."""
    with pytest.raises(ConfigError, match=f"^{named}: "):
        load_config(overrides, env={})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KVXFERD_PEER_PORT": "eighty"}, "KVXFERD_PEER_PORT"),
        ({"KVXFERD_CLAIM_S": "soon"}, "KVXFERD_CLAIM_S"),
        ({"KVXFERD_PROGRESS_THREAD": "maybe"}, "KVXFERD_PROGRESS_THREAD"),
        ({"KVXFERD_PEER_PORT": "70000"}, "peer_port"),
        ({"KVXFERD_PEER_FRAMES_PORT": "-2"}, "peer_frames_port"),
        ({"KVXFERD_PEER_FRAMES_PORT": "65536"}, "peer_frames_port"),
        ({"KVXFERD_CLAIM_S": "0"}, "claim_s"),
        ({"KVXFERD_DEFAULT_LEASE_S": "nan"}, "default_lease_s"),  # a hold that never expires
        ({"KVXFERD_MAX_CLAIM_S": "inf"}, "max_claim_s"),
        ({"KVXFERD_HOLD_GRACE_S": "nan"}, "hold_grace_s"),
        ({"KVXFERD_DEFAULT_LEASE_S": "900"}, "default_lease_s"),
        ({"KVXFERD_BACKENDS": " , "}, "backends"),
        ({"KVXFERD_EVENT_LOOP": "tokio"}, "event_loop"),
        ({"KVXFERD_HTTP": "h3"}, "http"),
        ({"KVXFERD_HANDSHAKE_TIMEOUT_S": "nan"}, "handshake_timeout_s"),
        ({"KVXFERD_HANDSHAKE_TIMEOUT_S": "0"}, "handshake_timeout_s"),
        ({"KVXFERD_SHUTDOWN_GRACE_S": "nan"}, "shutdown_grace_s"),  # SIGTERM must end it
        ({"KVXFERD_SHUTDOWN_GRACE_S": "-1"}, "shutdown_grace_s"),
        ({"KVXFERD_SHUTDOWN_GRACE_S": "601"}, "shutdown_grace_s"),
        ({"KVXFERD_ENGINE_ID": "a\nb"}, "engine_id"),  # a forged log or ready line
        ({"KVXFERD_ENGINE_ID": "kvx-1\n"}, "engine_id"),
        ({"KVXFERD_ENGINE_ID": "a b"}, "engine_id"),
        ({"KVXFERD_ENGINE_ID": "\u00e9"}, "engine_id"),
        ({"KVXFERD_ENGINE_ID": "x" * 129}, "engine_id"),
        ({"KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "0"}, "max_body_bytes_in_flight"),
    ],
)
def test_invalid_values_are_config_errors_naming_the_variable(env, named):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert str(info.value).startswith(named)


def test_an_engine_id_of_128_printable_characters_is_taken():
    engine_id = "pod-7/rank:0_" + "x" * 115
    assert load_config(env={"KVXFERD_ENGINE_ID": engine_id}).engine_id == engine_id


def test_an_unknown_override_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="^peer_colour: unknown setting"):
        load_config({"peer_colour": "blue"}, env={})


def test_the_config_is_frozen_and_replace_validates_again():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.peer_port = 1  # type: ignore[misc]
    assert replace(config, peer_port=7).peer_port == 7
    with pytest.raises(ConfigError, match="^peer_port"):
        replace(config, peer_port=-1)


def test_the_token_is_not_in_the_repr():
    assert "s3cret" not in repr(load_config(env={"KVXFERD_PEER_TOKEN": "s3cret"}))


def test_env_help_lists_every_field_with_its_docstring():
    rows = dict(env_help())
    assert list(rows) == [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Config)]
    assert all(doc and not doc.startswith(" ") for doc in rows.values()), rows
    assert all("\n" not in doc and "  " not in doc for doc in rows.values()), rows  # one line
    assert rows["KVXFERD_PEER_TOKEN"].startswith("Shared secret")
    assert rows["KVXFERD_PEER_PORT"] == "TCP port of the peer API; 0 picks a free one."


def test_the_frames_socket_sits_beside_the_engine_socket_unless_set_or_off():
    assert Config(engine_socket="/run/k.sock").frames_socket == "/run/k.sock.frames"
    set_ = Config(engine_socket="/run/k.sock", engine_frames_socket="/run/f.sock")
    assert set_.frames_socket == "/run/f.sock"
    assert Config(engine_frames_socket="off").frames_socket == ""


@pytest.mark.parametrize(
    "env",
    [{"KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": str((16 << 20) + 16383)},
     {"KVXFERD_MAX_BODY_BYTES": str(256 << 20)},
     {"KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "5000", "KVXFERD_MAX_BODY_BYTES": "4096",
      "KVXFERD_MAX_HEADER_BYTES": "1024"}],
    ids=["budget-lowered", "body-raised", "one-byte-short"],
)  # fmt: skip
def test_a_body_budget_that_cannot_hold_the_largest_frame_is_refused_naming_both(env):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    line = str(info.value)
    assert line.startswith("max_body_bytes_in_flight: ") and "\n" not in line
    assert "max_body_bytes + max_header_bytes" in line


def test_a_body_budget_of_exactly_the_largest_frame_is_taken():
    env = {"KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "5120", "KVXFERD_MAX_BODY_BYTES": "4096",
           "KVXFERD_MAX_HEADER_BYTES": "1024"}  # fmt: skip
    assert load_config(env=env).max_body_bytes_in_flight == 5120
    assert Config().max_body_bytes_in_flight == 256 << 20
