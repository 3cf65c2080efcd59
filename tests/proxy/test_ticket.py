"""The admission ticket: what a request takes (slot, peer) is given back once, and nothing else is."""

from __future__ import annotations

import asyncio
from time import perf_counter

import pytest

from engines.spec import Guards
from proxy.asgi import Message
from proxy.endpoints import CHAT
from proxy.errors import HTTPError
from proxy.health import REJOIN_S
from proxy.relay.drain import Drain
from proxy.relay.outcome import Outcome
from proxy.relay.routes import RouteEntry, Routes
from proxy.relay.ticket import Ticket
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress
from proxy.startup.settings import Settings

pytestmark = pytest.mark.anyio


def _entry(max_in_flight: int | None, *, max_queued: int = 4, replicas: int = 1) -> RouteEntry:
    addresses = [UpstreamAddress("127.0.0.1", 9000 + i) for i in range(replicas)]
    route = Route(
        model="m",
        upstream=addresses[0],
        guards=Guards(),
        max_in_flight=max_in_flight,
        replicas=tuple(Replica(a) for a in addresses) if replicas > 1 else (),
    )
    routes = Routes(Settings(max_queued=max_queued, queue_timeout_s=5, connect_timeout_s=1.0), None)
    return routes.update(RoutingTable([route]))["m"]


async def _connected() -> Message:
    """A client that stays: its receive() never returns."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _outcome() -> Outcome:
    outcome = Outcome(b"id", CHAT)
    outcome.model = "m"
    return outcome


async def test_admitted_ticket_holds_a_slot_and_a_peer_until_released() -> None:
    """A ticket on a free slot counts on the admission and the peer; release gives both back, once."""
    entry = _entry(1)
    ticket = Ticket()
    peer = ticket.take(entry, {})
    assert peer is not None
    assert entry.admission.in_flight == 1 and peer.in_flight == 1 and peer.served == 1
    ticket.release(perf_counter())
    assert entry.admission.in_flight == 0 and peer.in_flight == 0 and peer.served == 1


async def test_refused_ticket_gives_back_nothing_it_did_not_take() -> None:
    """A request refused with 429 (queue full) takes no slot, so its release leaves the holder's alone."""
    entry = _entry(1, max_queued=0)
    holder = Ticket()
    await holder.admit(entry, {}, _outcome(), _connected, Drain(), 0.0)
    refused = Ticket()
    assert refused.take(entry, {}) is None  # no free slot: a wait is needed
    with pytest.raises(HTTPError) as caught:
        await refused.admit(entry, {}, _outcome(), _connected, Drain(), 0.0)
    assert caught.value.status == 429
    refused.release(perf_counter())
    assert entry.admission.in_flight == 1 and entry.peers[0].in_flight == 1
    holder.release(perf_counter())
    assert entry.admission.in_flight == 0 and entry.peers[0].in_flight == 0


async def test_ticket_cancelled_in_the_queue_leaves_the_counts_as_they_were() -> None:
    """A request cancelled while it waits for a slot holds nothing, and its release frees nothing."""
    entry = _entry(1)
    holder = Ticket()
    await holder.admit(entry, {}, _outcome(), _connected, Drain(), 0.0)
    waiting = Ticket()
    task = asyncio.ensure_future(waiting.admit(entry, {}, _outcome(), _connected, Drain(), 0.0))
    await asyncio.sleep(0.01)
    assert entry.admission.queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    waiting.release(perf_counter())
    assert entry.admission.in_flight == 1 and entry.admission.queued == 0
    holder.release(perf_counter())
    assert entry.admission.in_flight == 0


async def test_queued_ticket_is_refused_once_the_drain_is_over() -> None:
    """Past a drain's end a request that finds no free slot is answered 503 draining, holding nothing."""
    entry = _entry(1)
    holder = Ticket()
    await holder.admit(entry, {}, _outcome(), _connected, Drain(), 0.0)
    drain = Drain()
    drain.end("the gateway is shutting down", [entry])
    late = Ticket()
    with pytest.raises(HTTPError) as caught:
        await late.admit(entry, {}, _outcome(), _connected, drain, 0.0)
    assert caught.value.status == 503 and caught.value.code == "draining"
    late.release(perf_counter())
    holder.release(perf_counter())
    assert entry.admission.in_flight == 0


async def test_tickets_spread_over_the_least_busy_peers() -> None:
    """With several replicas, each ticket takes the peer with the fewest requests in flight."""
    entry = _entry(None, replicas=2)
    first, second = Ticket(), Ticket()
    a, b = first.take(entry, {}), second.take(entry, {})
    assert a is not None and b is not None and a is not b
    first.release(perf_counter())
    third = Ticket()
    assert third.take(entry, {}) is a
    second.release(perf_counter())
    third.release(perf_counter())
    assert [p.in_flight for p in entry.peers] == [0, 0]


def _turn(system: str, turns: int) -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": f"question {turn}"} for turn in range(turns)]
    return {"model": "m", "messages": messages}


def test_a_model_with_one_replica_has_no_affinity_and_no_health() -> None:
    """One replica: no affinity memory and no health state, so the hot path does no such work."""
    entry = _entry(None)
    assert entry.affinity is None
    assert all(peer.health is None for peer in entry.peers)


async def test_a_conversation_s_next_turn_goes_where_its_first_went() -> None:
    """With affinity, the second turn takes the peer of the first even though the other is as idle."""
    entry = _entry(None, replicas=2)
    assert entry.affinity is not None
    seen = []
    for system in ("first " * 100, "second " * 100):
        ticket = Ticket()
        seen.append(ticket.take(entry, _turn(system, 1)))
        ticket.release(perf_counter())
    assert seen[0] is not seen[1]  # two new conversations: spread
    for index, system in enumerate(("first " * 100, "second " * 100)):
        ticket = Ticket()
        assert ticket.take(entry, _turn(system, 2)) is seen[index]
        ticket.release(perf_counter())
    assert sum(entry.affinity.hits) == 2


async def test_an_ejected_peer_gets_nothing_and_all_out_is_503() -> None:
    """An ejected peer is skipped; with every peer out a request gets 503 no_healthy_replica."""
    entry = _entry(None, replicas=2)
    first, second = entry.peers
    assert first.health is not None and second.health is not None
    first.health.connect_failed("refused")
    for _ in range(3):
        ticket = Ticket()
        assert ticket.take(entry, {}) is second
        ticket.release(perf_counter())
    second.health.connect_failed("refused too")
    ticket = Ticket()
    with pytest.raises(HTTPError) as caught:
        ticket.take(entry, {})
    ticket.release(perf_counter())
    assert caught.value.status == 503 and caught.value.code == "no_healthy_replica"
    assert (b"retry-after", b"2") in caught.value.headers
    assert "refused too" in str(caught.value)


async def test_all_out_says_when_the_first_replica_is_tried_again() -> None:
    """Every peer ejected by its probe (tried again in REJOIN_S): the 503's Retry-After says when."""
    entry = _entry(None, replicas=2)
    for peer in entry.peers:
        assert peer.health is not None
        peer.health.eject("its own test request failed", by_probe=True)
    ticket = Ticket()
    with pytest.raises(HTTPError) as caught:
        ticket.take(entry, {})
    ticket.release(perf_counter())
    assert caught.value.code == "no_healthy_replica"
    assert (b"retry-after", b"%d" % REJOIN_S) in caught.value.headers


async def test_moving_a_request_takes_an_untried_peer_and_moves_its_count() -> None:
    """move() gives the request to a peer not tried yet, counting it there; none left: None."""
    entry = _entry(None, replicas=3)
    ticket = Ticket()
    first = ticket.take(entry, {})
    assert first is not None
    tried = {first}
    moved = ticket.move(entry, {}, tried)
    assert moved is not None and moved is not first
    assert first.in_flight == 0 and moved.in_flight == 1
    tried.add(moved)
    last = ticket.move(entry, {}, tried)
    assert last is not None and last not in tried
    tried.add(last)
    assert ticket.move(entry, {}, tried) is None
    ticket.release(perf_counter())
    assert [p.in_flight for p in entry.peers] == [0, 0, 0]


def test_a_route_changed_only_in_aliases_or_limit_keeps_its_entry() -> None:
    """A reload that changes a model's aliases or limit keeps its admission (with the new limit), its
    peers and its counters; one that changes its upstream gets a new entry."""
    address = UpstreamAddress("127.0.0.1", 9000)
    route = Route(model="m", upstream=address, guards=Guards(), max_in_flight=1)
    routes = Routes(Settings(max_queued=4, queue_timeout_s=5, connect_timeout_s=1.0), None)
    before = routes.update(RoutingTable([route]))["m"]
    assert before.admission.try_enter()
    retuned = Route(model="m", upstream=address, guards=Guards(), max_in_flight=2, aliases=("alias",))
    after = routes.update(RoutingTable([retuned]))
    assert after["m"] is before and after["alias"].admission is before.admission
    assert after["alias"].rename == "m"
    assert before.admission.limit == 2 and before.admission.in_flight == 1
    moved = Route(model="m", upstream=UpstreamAddress("127.0.0.1", 9001), guards=Guards(), max_in_flight=2)
    assert routes.update(RoutingTable([moved]))["m"].admission is not before.admission
