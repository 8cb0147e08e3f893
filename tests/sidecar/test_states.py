"""Pull and hold states only move forward; terminal states never move again."""

from __future__ import annotations

import itertools
import typing

import pytest

from kvxferd.errors import KvxferdError, StateError
from kvxferd.sidecar.states import HoldState, PullState, advance, overall
from kvxferd.wire import PullStateName


def test_pull_states_are_ordered_by_progress():
    assert (
        PullState.PENDING
        < PullState.HANDSHAKING
        < PullState.CLAIMING
        < PullState.TRANSFERRING
        < PullState.DONE
    )
    assert min(PullState.TRANSFERRING, PullState.CLAIMING) is PullState.CLAIMING
    assert [s for s in PullState if s.terminal] == [PullState.DONE, PullState.FAILED]


def test_pull_state_names_are_the_wire_names():
    assert [s.wire_name for s in PullState] == list(typing.get_args(PullStateName))
    for state in PullState:
        assert PullState.from_wire(state.wire_name) is state
    with pytest.raises(ValueError, match="paused"):
        PullState.from_wire("paused")  # type: ignore[arg-type]


@pytest.mark.parametrize("machine", [PullState, HoldState])
def test_every_forward_move_from_a_live_state_is_allowed(machine):
    for a, b in itertools.combinations(machine, 2):  # a < b
        if a.terminal:
            with pytest.raises(StateError):
                advance(a, b)
        else:
            assert advance(a, b) is b


@pytest.mark.parametrize("machine", [PullState, HoldState])
def test_backward_and_repeated_moves_raise(machine):
    for a, b in itertools.product(machine, repeat=2):
        if b <= a:
            with pytest.raises(StateError) as err:
                advance(a, b)
            assert isinstance(err.value, KvxferdError)
            assert (err.value.current, err.value.new) == (a, b)


def test_failed_is_sticky_and_done_is_final():
    for state in PullState:
        with pytest.raises(StateError, match="FAILED is terminal"):
            advance(PullState.FAILED, state)
    with pytest.raises(StateError, match="DONE is terminal"):
        advance(PullState.DONE, PullState.FAILED)
    # Any live state can fail, skipping what is left.
    assert advance(PullState.PENDING, PullState.FAILED) is PullState.FAILED


def test_released_hold_is_terminal_and_machines_do_not_mix():
    assert advance(HoldState.HELD, HoldState.RELEASED) is HoldState.RELEASED
    with pytest.raises(StateError, match="RELEASED is terminal"):
        advance(HoldState.RELEASED, HoldState.RELEASED)
    with pytest.raises(StateError, match="different machines"):
        advance(HoldState.HELD, PullState.DONE)  # type: ignore[type-var]


def test_failed_is_never_read_as_progress_over_several_ranks():
    assert overall([PullState.TRANSFERRING, PullState.CLAIMING]) is PullState.CLAIMING
    assert overall([PullState.DONE, PullState.DONE]) is PullState.DONE
    # FAILED is the largest integer, yet one failed rank fails the whole, even next to DONE.
    assert overall([PullState.DONE, PullState.FAILED]) is PullState.FAILED
    assert overall([PullState.FAILED, PullState.PENDING]) is PullState.FAILED
    with pytest.raises(ValueError, match="no states"):
        overall([])


def _pull():
    from kvxferd.sidecar.pulls import Pull
    from kvxferd.wire import PullRequest

    return Pull(pull_id="p", request=PullRequest(tickets=[], block_ids=[[1, -1, 3]]))


def test_a_pull_record_moves_only_through_advance():
    pull = _pull()
    pull.advance(PullState.CLAIMING)
    pull.advance(PullState.HANDSHAKING)  # another rank is behind: no move, no error
    assert pull.state is PullState.CLAIMING
    pull.advance(PullState.DONE)
    with pytest.raises(StateError, match="DONE is terminal"):
        pull.fail("deadline", "too late")  # a finished pull cannot be failed afterwards
    assert (pull.state, pull.reason) == (PullState.DONE, "")


def test_a_failed_pull_stays_failed_and_lists_its_local_blocks_as_invalid():
    pull = _pull()
    pull.advance(PullState.TRANSFERRING)
    pull.fail("claim_timeout", "no answer")
    for state in PullState:
        with pytest.raises(StateError, match="FAILED is terminal"):
            pull.advance(state)
    entry = pull.finished()
    assert (entry.state, entry.reason, entry.failed_block_ids) == ("failed", "claim_timeout",
                                                                   [[1, 3]])  # fmt: skip
