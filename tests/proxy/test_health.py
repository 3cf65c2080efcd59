"""proxy.health: when a replica of a set leaves rotation and when it comes back (passive rules)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.health import MAX_FAILS, REJOIN_S, Checked, PeerHealth, follow_child
from proxy.routing import UpstreamAddress


def test_a_refused_connection_ejects_at_once_and_counts_one_ejection() -> None:
    """One connect failure takes the replica out (the request goes elsewhere); a second adds no ejection."""
    health = PeerHealth("m b", active=True)
    health.connect_failed("cannot connect to upstream b:1: refused")
    assert not health.up and health.ejections == 1 and "refused" in health.reason
    health.connect_failed("again")
    assert health.ejections == 1


def test_5xx_ejects_only_after_max_fails_in_a_row() -> None:
    """A single 5xx may be the request's fault: MAX_FAILS in a row eject, an answer below 500 resets."""
    health = PeerHealth("m a", active=True)
    for _ in range(MAX_FAILS - 1):
        health.answered(500)
    health.answered(404)  # the engine answered: the count starts again
    for _ in range(MAX_FAILS - 1):
        health.answered(503)
    assert health.up and health.ejections == 0
    health.answered(502)
    assert not health.up and health.ejections == 1


def test_rejoining_restores_rotation_and_clears_the_count() -> None:
    """A passed check brings an ejected replica back with no 5xx counted."""
    health = PeerHealth("m a", active=True)
    for _ in range(MAX_FAILS):
        health.answered(500)
    health.rejoin()
    assert health.up and health.fails == 0 and health.ejections == 1


def test_an_ejection_forgets_what_the_replica_was_sent() -> None:
    """The ejection hook runs once per ejection (affinity forgets the replica's cache)."""
    calls: list[int] = []
    health = PeerHealth("m a", active=True, on_eject=lambda: calls.append(1))
    health.eject("x")
    health.eject("y")
    health.rejoin()
    health.eject("z")
    assert calls == [1, 1]


@pytest.mark.anyio
async def test_a_replica_ejected_for_5xx_is_held_out_by_passing_checks() -> None:
    """Its /health may pass while generations fail: a passed check brings it back only after REJOIN_S."""
    health = PeerHealth("m a", active=True)
    for _ in range(MAX_FAILS):
        health.answered(500)
    now = asyncio.get_running_loop().time()
    health.passed(now + 1)
    assert not health.up
    health.passed(now + REJOIN_S + 1)
    assert health.up


@pytest.mark.anyio
async def test_a_replica_that_refused_rejoins_at_the_first_passed_check() -> None:
    """A connect failure holds nothing: the first check that passes brings the replica back."""
    health = PeerHealth("m a", active=True)
    health.connect_failed("refused")
    health.passed(asyncio.get_running_loop().time())
    assert health.up


class ChildGate:
    """What the relay reads of an engine child (``routing.ReplicaGate``): ready, and its start count."""

    def __init__(self) -> None:
        self.ready = True
        self.starts = 1


def test_an_ejected_child_rejoins_once_its_manager_has_a_new_process_ready() -> None:
    """No HTTP for a child: its health follows its manager's state; the same process stays out, a new
    one that is ready comes back (its 5xx hold too: it is another process)."""
    gate = ChildGate()
    health = PeerHealth("m 0", active=False)
    replica = Checked(UpstreamAddress("127.0.0.1", 1), health, gate)
    for _ in range(MAX_FAILS):
        health.answered(500)
    follow_child(replica)
    assert not health.up  # the same process: out until REJOIN_S
    gate.ready, gate.starts = False, 2  # its manager restarts it
    follow_child(replica)
    assert not health.up
    gate.ready = True
    follow_child(replica)
    assert health.up and health.fails == 0
    health.connect_failed("refused")
    follow_child(replica)
    assert not health.up  # no new start since: nothing brings it back early
