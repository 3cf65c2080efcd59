"""proxy.health: when a replica of a set leaves rotation and when it comes back (passive rules)."""

from __future__ import annotations

import asyncio

import pytest

from proxy import health as health_module
from proxy.health import Checked, PeerHealth, Probe, follow_child
from proxy.routing import UpstreamAddress


def test_a_refused_connection_ejects_at_once_and_counts_one_ejection() -> None:
    """One connect failure takes the replica out (the request goes elsewhere); a second adds no ejection."""
    health = PeerHealth("m b", active=True)
    health.connect_failed("cannot connect to upstream b:1: refused")
    assert not health.up and health.ejections == 1 and "refused" in health.reason
    health.connect_failed("again")
    assert health.ejections == 1


class FakeProbe(Probe):
    """A probe that answers what the test says, counting its runs."""

    def __init__(self, problem: str | None) -> None:
        super().__init__(UpstreamAddress("127.0.0.1", 1), "m", 1.0, 1.0)
        self.problem = problem
        self.runs: list[bytes] = []

    async def run(self, target: bytes) -> str | None:
        self.runs.append(target)
        return self.problem


async def _settle(health: PeerHealth) -> None:
    """Let a probe that a 5xx started finish."""
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.anyio
async def test_5xx_answers_never_eject_a_replica_whose_own_test_request_passes() -> None:
    """A 5xx may be the request's own fault: however many come, a replica that serves its probe stays."""
    probe = FakeProbe(None)
    health = PeerHealth("m a", active=True, probe=probe)
    for _ in range(20):
        health.answered(502, b"/v1/chat/completions")
        await _settle(health)
    assert health.up and health.ejections == 0 and health.suspects == 20
    # One probe, then none within the cooldown: a repeated bad request costs one test request.
    assert probe.runs == [b"/v1/chat/completions"]


@pytest.mark.anyio
async def test_a_5xx_whose_probe_fails_too_ejects_at_once() -> None:
    """A server that fails its own known-good request is unwell: one 5xx then ejects it, saying both."""
    health = PeerHealth("m a", active=True, probe=FakeProbe("it answered 500"))
    health.answered(500, b"/v1/completions")
    await _settle(health)
    assert not health.up and health.ejections == 1
    assert health.reason == "a request got 500, and its own test request failed: it answered 500"


@pytest.mark.anyio
async def test_probes_are_sent_again_only_after_the_cooldown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the cooldown is over, the next 5xx is probed again (the server may have turned bad since)."""
    monkeypatch.setattr(health_module, "PROBE_COOLDOWN_S", 0.05)
    probe = FakeProbe(None)
    health = PeerHealth("m a", active=True, probe=probe)
    health.answered(502, b"/v1/chat/completions")
    await _settle(health)
    await asyncio.sleep(0.1)
    probe.problem = "no answer in time"
    health.answered(504, b"/v1/chat/completions")
    await _settle(health)
    assert len(probe.runs) == 2 and not health.up


def test_without_a_probe_a_5xx_counts_for_nothing() -> None:
    """No probe to ask (and no running loop): 5xx answers are only counted."""
    health = PeerHealth("m a", active=True)
    for _ in range(10):
        health.answered(500, b"/v1/chat/completions")
    assert health.up and health.suspects == 10


def test_rejoining_restores_rotation() -> None:
    """Rejoining brings an ejected replica back and keeps its count of ejections."""
    health = PeerHealth("m a", active=True)
    health.eject("x", by_probe=True)
    health.rejoin()
    assert health.up and health.ejections == 1


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
async def test_a_replica_ejected_by_its_probe_comes_back_by_a_probe_not_a_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its /health may pass while generations fail: passed checks keep it out; a probe that passes,
    tried every REJOIN_S, brings it back."""
    monkeypatch.setattr(health_module, "REJOIN_S", 0.05)
    probe = FakeProbe("it answered 500")
    health = PeerHealth("m a", active=True, probe=probe)
    health.answered(500, b"/v1/chat/completions")
    await _settle(health)
    assert not health.up
    health.passed()
    assert not health.up
    await asyncio.sleep(0.2)  # probed again, and still failing
    assert not health.up and len(probe.runs) >= 2
    assert health.reason.startswith("its own test request still fails")
    probe.problem = None
    deadline = asyncio.get_running_loop().time() + 5
    while not health.up:
        assert asyncio.get_running_loop().time() < deadline, health
        await asyncio.sleep(0.02)
    assert health.ejections == 1


@pytest.mark.anyio
async def test_a_replica_that_refused_rejoins_at_the_first_passed_check() -> None:
    """A connect failure holds nothing: the first check that passes brings the replica back."""
    health = PeerHealth("m a", active=True)
    health.connect_failed("refused")
    health.passed()
    assert health.up


def test_the_probe_asks_each_endpoint_a_known_good_question() -> None:
    """One token of chat or completion, or one embedding, under the model's own name."""
    probe = Probe(UpstreamAddress("127.0.0.1", 1), "qwen", 1.0, 1.0)
    chat = probe.body(b"/v1/chat/completions")
    assert chat["model"] == "qwen" and chat["max_tokens"] == 1 and chat["messages"][0]["role"] == "user"
    assert probe.body(b"/p/v1/completions") == {"model": "qwen", "prompt": "ping", "max_tokens": 1}
    assert probe.body(b"/v1/embeddings") == {"model": "qwen", "input": "ping"}


class ChildGate:
    """What the relay reads of an engine child (``routing.ReplicaGate``): ready, and its start count."""

    def __init__(self) -> None:
        self.ready = True
        self.starts = 1
        self.name = "child-0"

    def exited(self) -> bool:
        return not self.ready


def test_an_ejected_child_rejoins_once_its_manager_has_a_new_process_ready() -> None:
    """No HTTP for a child: its health follows its manager's state; the same process stays out, a new
    one that is ready comes back (even one its probe ejected: it is another process)."""
    gate = ChildGate()
    health = PeerHealth("m 0", active=False)
    replica = Checked(UpstreamAddress("127.0.0.1", 1), health, gate)
    health.eject("a request got 500, and its own test request failed: it answered 500", by_probe=True)
    follow_child(replica)
    assert not health.up  # the same process: out until a probe passes
    gate.ready, gate.starts = False, 2  # its manager restarts it
    follow_child(replica)
    assert not health.up
    gate.ready = True
    follow_child(replica)
    assert health.up
    health.connect_failed("refused")
    follow_child(replica)
    assert not health.up  # no new start since: nothing brings it back early
