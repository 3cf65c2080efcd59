"""Admission: the ticket a request holds while it is served, and the waits to get it.

A ticket is taken piece by piece (the model's gate, then a slot, then a
replica), each piece only once the one before it is held: at once where
nothing needs a wait (``take``, the fast path), else by waiting for the
model's load or a place in the queue (``admit``). It is released
once, in the handler's one ``finally``: whatever was taken is given back,
whatever was not is not, on every path (a reply, a refusal, a client that
left, a cancellation, a drain).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection
from time import perf_counter
from typing import Any

from mypy_extensions import mypyc_attr

from proxy.admission import Admission
from proxy.asgi import Receive
from proxy.errors import HTTPError
from proxy.relay.drain import Drain
from proxy.relay.failures import loading, no_replica
from proxy.relay.outcome import Outcome
from proxy.relay.routes import Peer, RouteEntry, by_affinity, least_busy
from proxy.routing import Gate
from proxy.upstream_errors import ClientGone


# Made for each request: a freed one is kept for the next (compiled).
@mypyc_attr(free_list_len=1)
class Ticket:
    """What one request holds: its model's gate (in use), a slot of its admission, a peer's count."""

    # Each one None until taken: on the class, so that a new ticket costs no ``__init__``.
    gate: Gate | None = None
    slot: Admission | None = None
    peer: Peer | None = None

    def take(self, entry: RouteEntry, doc: Any) -> Peer | None:
        """Take the gate, a slot and a peer where none needs a wait (the fast path); None if one does.

        What was taken stays on the ticket: ``admit`` waits for the rest.
        """
        gate = entry.gate
        if gate is not None:
            if not gate.ready:
                return None
            # In use from here, queued or not: never unloaded under this request.
            gate.enter()
            self.gate = gate
        admission = entry.admission
        if not admission.try_enter():
            return None
        self.slot = admission
        peers = entry.peers
        if len(peers) != 1:
            return self._pick(entry, doc)
        # One peer: that one (``_pick``'s first case, written out).
        peer = peers[0]
        peer.in_flight += 1
        peer.served += 1
        self.peer = peer
        return peer

    async def admit(
        self,
        entry: RouteEntry,
        doc: Any,
        outcome: Outcome,
        receive: Receive,
        drain: Drain,
        load_wait_s: float,
    ) -> Peer:
        """Wait for what ``take`` could not get: the model's load, then a slot; then take a peer.

        Raises HTTPError (429, 503) or ClientGone; what was taken by then
        stays on the ticket, for ``release``.
        """
        gate, admission = entry.gate, entry.admission
        if gate is not None and self.gate is None:
            if not gate.ready:
                admission.wait_for_load(outcome.model)
                try:
                    ready = await wait_for_model(gate, receive, drain, load_wait_s)
                finally:
                    admission.loading -= 1
                if not ready:
                    raise loading(gate.not_ready_reason())
                # Starting the model, or waiting for it, is not the gateway's own time.
                outcome.started = perf_counter()
            gate.enter()
            self.gate = gate
        if admission.try_enter():
            self.slot = admission
        else:
            if drain.refusal is not None:
                raise drain.refusal  # the drain is over: no new place in the queue
            queued_at = perf_counter()
            await wait_for_slot(admission, outcome.model, receive)
            self.slot = admission
            if entry.stats is not None:
                entry.stats.queue_time.observe(perf_counter() - queued_at)
            # Waiting for a slot is not the gateway's own time either.
            outcome.started = perf_counter()
            if gate is not None and not gate.ready:
                # Its children went away while this request was queued.
                raise loading(gate.not_ready_reason())
        return self._pick(entry, doc)

    def _pick(self, entry: RouteEntry, doc: Any) -> Peer:
        """The peer that takes the request, counted as busy with it.

        One peer: that one, with no further work. Several: by affinity
        (``doc`` is the parsed body), or the least busy; only available ones.
        """
        peers = entry.peers
        if len(peers) == 1:
            peer: Peer | None = peers[0]
        elif entry.affinity is not None:
            peer = by_affinity(peers, entry.affinity, doc)
        else:
            peer = least_busy(peers)
        if peer is None:
            # No peer is available (only a model with several can get here).
            raise _none_available(entry)
        peer.in_flight += 1
        peer.served += 1
        self.peer = peer
        return peer

    def move(self, entry: RouteEntry, doc: Any, tried: Collection[Peer]) -> Peer | None:
        """Another peer for a request that could not connect to its own (it reached no engine).

        The least busy available one not ``tried``; None when there is none.
        """
        old = self.peer
        peer = least_busy(entry.peers, tried)
        if peer is None:
            return None
        if old is not None:
            old.in_flight -= 1
            old.moved_away += 1
        peer.in_flight += 1
        peer.served += 1
        self.peer = peer
        if entry.affinity is not None:
            entry.affinity.record(entry.peers.index(peer), doc)
        return peer

    def release(self, slot_at: float) -> None:
        """Give back what was taken: the slot (taken at ``slot_at``, perf_counter's clock), the
        peer's count, the gate. Called once."""
        if self.slot is not None:
            # The time held feeds the queue's drain rate (its Retry-After).
            self.slot.leave(perf_counter() - slot_at)
        if self.peer is not None:
            self.peer.in_flight -= 1
        if self.gate is not None:
            self.gate.leave()


def _none_available(entry: RouteEntry) -> HTTPError:
    gate = entry.gate
    if gate is not None and not gate.ready:
        return loading(gate.not_ready_reason())
    out = [(p.name, p.health) for p in entry.peers if p.health is not None and not p.health.up]
    reasons = "; ".join(f"{name}: {health.reason}" for name, health in out)
    # Come back when the first of them is tried again, if each one says when.
    backs = [health.back_in_s() for _, health in out]
    known = [back for back in backs if back is not None]
    back_in_s = min(known) if known and len(known) == len(backs) else None
    return no_replica(
        f"no replica of this model is in rotation now ({reasons or 'none is ready'})", back_in_s
    )


async def wait_for_model(gate: Gate, receive: Receive, drain: Drain, load_wait_s: float) -> bool:
    """Wait for a model to load (or restart), watching the client and the drain; whether it is ready."""
    ready = asyncio.ensure_future(gate.wait_ready(load_wait_s))
    gone = asyncio.ensure_future(receive())
    ended = asyncio.ensure_future(drain.ended.wait())
    try:
        await asyncio.wait({ready, gone, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (ready, gone, ended):
            # Only this wait ends: a load is shared, and goes on.
            if not waiting.done():
                waiting.cancel()
    if ready.done() and not ready.cancelled():
        return ready.result()
    if ended.done() and drain.refusal is not None:
        raise drain.refusal
    raise ClientGone()


async def wait_for_slot(admission: Admission, model: str, receive: Receive) -> None:
    """Queue for a slot, watching the client: one that leaves while queued gives its place up."""
    enter = asyncio.ensure_future(admission.enter(model))
    gone = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({enter, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled while queued: give the place (or a slot just granted) back.
        enter.cancel()
        try:
            await enter
        except (asyncio.CancelledError, HTTPError):
            pass
        else:
            admission.leave()  # the slot had been granted: pass it on
        raise
    finally:
        if not gone.done():
            gone.cancel()
    if not gone.done() or gone.cancelled():
        enter.result()  # the slot, or the 429/503 HTTPError
        return
    # The client left while queued.
    if enter.done():
        if enter.exception() is None:
            admission.leave()
    else:
        enter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await enter
    raise ClientGone()
