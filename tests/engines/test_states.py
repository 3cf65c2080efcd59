"""engines.child.TRANSITIONS: the child lifecycle as data."""

from __future__ import annotations

import pytest

from engines.child import TRANSITIONS, ChildState

S = ChildState

# The moves drawn in design.md's "Child lifecycle" diagram.
DIAGRAM = [
    (S.STOPPED, S.STARTING),  # start, or backoff after a crash
    (S.STARTING, S.READY),  # ready
    (S.READY, S.STOPPING),  # stop / idle
    (S.STOPPING, S.STOPPED),  # exited
    (S.STARTING, S.STOPPED),  # exit / timeout, last error kept
    (S.READY, S.STOPPED),  # crash
]


def test_every_state_has_a_row() -> None:
    """TRANSITIONS has exactly one row per ChildState."""
    assert set(TRANSITIONS) == set(ChildState)


def test_moves_stay_within_the_enum() -> None:
    """Every target of every move is a ChildState."""
    for targets in TRANSITIONS.values():
        assert targets <= set(ChildState)


def test_shutdown_is_final() -> None:
    """SHUTDOWN has no moves out."""
    assert TRANSITIONS[S.SHUTDOWN] == frozenset()


@pytest.mark.parametrize("state", [s for s in ChildState if s is not S.SHUTDOWN], ids=lambda s: s.value)
def test_every_other_state_can_shut_down(state: ChildState) -> None:
    """Shutdown is reachable from every state but itself."""
    assert S.SHUTDOWN in TRANSITIONS[state]


def test_no_state_moves_to_itself() -> None:
    """A move always changes the state."""
    for state, targets in TRANSITIONS.items():
        assert state not in targets


def test_ready_does_not_restart_directly() -> None:
    """READY cannot go straight to STARTING: a crash goes through STOPPED, then backoff, then start."""
    assert S.STARTING not in TRANSITIONS[S.READY]
    assert S.STOPPED in TRANSITIONS[S.READY]
    assert S.STARTING in TRANSITIONS[S.STOPPED]


def test_stopped_cannot_become_ready_without_starting() -> None:
    """STOPPED cannot go to READY: readiness is only proven by a start."""
    assert S.READY not in TRANSITIONS[S.STOPPED]


def test_only_starting_reaches_ready() -> None:
    """READY is entered only from STARTING."""
    assert [s for s, targets in TRANSITIONS.items() if S.READY in targets] == [S.STARTING]


@pytest.mark.parametrize(("source", "target"), DIAGRAM, ids=[f"{a.value}->{b.value}" for a, b in DIAGRAM])
def test_diagram_moves_are_allowed(source: ChildState, target: ChildState) -> None:
    """Each move drawn in design.md's lifecycle diagram is in the table."""
    assert target in TRANSITIONS[source]


def test_every_state_reachable_from_stopped() -> None:
    """Starting from STOPPED, every state can be reached through allowed moves."""
    seen = {S.STOPPED}
    frontier = [S.STOPPED]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(ChildState)
