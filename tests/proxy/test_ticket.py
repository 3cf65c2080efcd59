"""The admission ticket: what a request takes (slot, peer) is given back once, and nothing else is."""

from __future__ import annotations

import asyncio

import pytest

from proxy.asgi import Message
from proxy.errors import HTTPError
from proxy.relay.drain import Drain
from proxy.relay.outcome import Outcome
from proxy.relay.routes import RouteEntry, Routes
from proxy.relay.settings import RelaySettings
from proxy.relay.ticket import Ticket
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress

pytestmark = pytest.mark.anyio


def _entry(max_in_flight: int | None, *, max_queued: int = 4, replicas: int = 1) -> RouteEntry:
    addresses = [UpstreamAddress("127.0.0.1", 9000 + i) for i in range(replicas)]
    route = Route(
        model="m",
        upstream=addresses[0],
        max_in_flight=max_in_flight,
        replicas=tuple(Replica(a) for a in addresses) if replicas > 1 else (),
    )
    routes = Routes(RelaySettings(max_queued=max_queued, queue_timeout_s=5), None, 1.0)
    return routes.update(RoutingTable([route]))["m"]


async def _connected() -> Message:
    """A client that stays: its receive() never returns."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _outcome() -> Outcome:
    outcome = Outcome(b"id")
    outcome.model = "m"
    return outcome


async def test_admitted_ticket_holds_a_slot_and_a_peer_until_released() -> None:
    """A ticket on a free slot counts on the admission and the peer; release gives both back, once."""
    entry = _entry(1)
    ticket = Ticket()
    peer = ticket.take(entry)
    assert peer is not None
    assert entry.admission.in_flight == 1 and peer.in_flight == 1 and peer.served == 1
    ticket.release()
    assert entry.admission.in_flight == 0 and peer.in_flight == 0 and peer.served == 1


async def test_refused_ticket_gives_back_nothing_it_did_not_take() -> None:
    """A request refused with 429 (queue full) takes no slot, so its release leaves the holder's alone."""
    entry = _entry(1, max_queued=0)
    holder = Ticket()
    await holder.admit(entry, _outcome(), _connected, Drain(), 0.0)
    refused = Ticket()
    assert refused.take(entry) is None  # no free slot: a wait is needed
    with pytest.raises(HTTPError) as caught:
        await refused.admit(entry, _outcome(), _connected, Drain(), 0.0)
    assert caught.value.status == 429
    refused.release()
    assert entry.admission.in_flight == 1 and entry.peers[0].in_flight == 1
    holder.release()
    assert entry.admission.in_flight == 0 and entry.peers[0].in_flight == 0


async def test_ticket_cancelled_in_the_queue_leaves_the_counts_as_they_were() -> None:
    """A request cancelled while it waits for a slot holds nothing, and its release frees nothing."""
    entry = _entry(1)
    holder = Ticket()
    await holder.admit(entry, _outcome(), _connected, Drain(), 0.0)
    waiting = Ticket()
    task = asyncio.ensure_future(waiting.admit(entry, _outcome(), _connected, Drain(), 0.0))
    await asyncio.sleep(0.01)
    assert entry.admission.queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    waiting.release()
    assert entry.admission.in_flight == 1 and entry.admission.queued == 0
    holder.release()
    assert entry.admission.in_flight == 0


async def test_queued_ticket_is_refused_once_the_drain_is_over() -> None:
    """Past a drain's end a request that finds no free slot is answered 503 draining, holding nothing."""
    entry = _entry(1)
    holder = Ticket()
    await holder.admit(entry, _outcome(), _connected, Drain(), 0.0)
    drain = Drain()
    drain.end("the gateway is shutting down", [entry])
    late = Ticket()
    with pytest.raises(HTTPError) as caught:
        await late.admit(entry, _outcome(), _connected, drain, 0.0)
    assert caught.value.status == 503 and caught.value.code == "draining"
    late.release()
    holder.release()
    assert entry.admission.in_flight == 0


async def test_tickets_spread_over_the_least_busy_peers() -> None:
    """With several replicas, each ticket takes the peer with the fewest requests in flight."""
    entry = _entry(None, replicas=2)
    first, second = Ticket(), Ticket()
    a, b = first.take(entry), second.take(entry)
    assert a is not None and b is not None and a is not b
    first.release()
    third = Ticket()
    assert third.take(entry) is a
    second.release()
    third.release()
    assert [p.in_flight for p in entry.peers] == [0, 0]
