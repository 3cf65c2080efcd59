"""The relay's ASGI entry: one request, read, parsed, admitted, exchanged and recorded."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any, Final

import orjson

from proxy.accesslog import AccessLog
from proxy.asgi import Receive, Scope, Send
from proxy.assembly import ReplyAssembler
from proxy.endpoints import CHAT, ENDPOINTS, Endpoint
from proxy.errors import HTTPError, echo
from proxy.metrics import Metrics
from proxy.payload import ask_for_stream, check_request, parse_request
from proxy.pool import Pool
from proxy.protocol import FastClient
from proxy.relay.drain import Drain
from proxy.relay.exchange import Exchange
from proxy.relay.failures import refuse
from proxy.relay.fast import FastExchange
from proxy.relay.head import HeadFields
from proxy.relay.ids import RequestIds
from proxy.relay.outcome import Outcome
from proxy.relay.request import BodyBudget, RequestBody, read_request, refuses_head
from proxy.relay.routes import ModelLoad, Peer, RouteEntry, Routes
from proxy.relay.settings import RelaySettings
from proxy.relay.ticket import Ticket
from proxy.routing import RoutingTable, UpstreamAddress
from proxy.splice import splice
from proxy.upstream_errors import ClientGone, ConnectFailed

log: Final = logging.getLogger("blazar.relay")


class Relay:
    """The relay endpoint, as a pure ASGI application."""

    def __init__(
        self,
        table: RoutingTable,
        settings: RelaySettings,
        metrics: Metrics | None = None,
        access_log: AccessLog | None = None,
        arrived: Callable[[Outcome], None] | None = None,
    ) -> None:
        self._routes = Routes(settings, metrics)
        # Told of each request as it arrives: the status page's bounded deque's append (its only
        # cost here); by default a deque that keeps none.
        self._arrived = arrived or collections.deque[Outcome](maxlen=0).append
        self.pools: dict[UpstreamAddress, Pool] = self._routes.pools
        self._entries: dict[str, RouteEntry] = {}
        self.update(table)
        self.checks = self._routes.checks
        self._metrics = metrics
        self._access = access_log
        if metrics is not None:
            metrics.watch_admission(self._routes.admission_sample)
            metrics.watch_replicas(self._routes.replica_sample)
        self.request_id_of = RequestIds()
        self._drain = self.drain = Drain()
        self._exchange = Exchange(settings, self._drain)
        # The fields that never cross upstream (``HeadFields`` notes the checks' among them).
        self.request_drop = self._exchange.request_drop
        # A body larger than the whole budget could never be served: 413, not a 503 to retry forever.
        self._max_body_bytes = min(settings.max_body_bytes, settings.body_budget_bytes)
        # Every body held at once, the protocol's too (a body still coming, ``proxy/lean.py``).
        self._body_budget = self.body_budget = BodyBudget(settings.body_budget_bytes)
        self._load_wait_s = settings.load_wait_s
        # The fast path's deadline for the head; with a whole-request limit, no fast path.
        self._head_timeout_s = settings.first_byte_timeout_s
        self._total_timeout_s = settings.total_timeout_s
        # What a stream relayed from callbacks keeps as the task path does.
        self.read_timeout_s = settings.read_timeout_s
        self.heartbeat_s = settings.heartbeat_s
        self.send_stall_s = settings.send_stall_s

    @property
    def table(self) -> RoutingTable:
        return self._routes.table

    def load(self) -> dict[str, ModelLoad]:
        """Each model's requests in flight and queued, and its replicas' (``Routes.load``)."""
        return self._routes.load()

    def update(self, table: RoutingTable) -> None:
        """Serve ``table`` from now on (a configuration reload); see ``Routes.update``."""
        self._entries = self._routes.update(table)

    def abort_all(self, reason: str) -> int:
        """End everything still running or waiting (a drain that ran out of time); return how many."""
        return self._drain.end(reason, self._entries.values())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request: read, parse, admit, exchange, record."""
        outcome = Outcome(self.request_id_of(scope), ENDPOINTS[scope["path"]])
        self._arrived(outcome)
        ticket = Ticket()
        body = RequestBody(self._body_budget)
        try:
            try:
                await read_request(scope, receive, self._max_body_bytes, body)
                # The client's upload time is not the gateway's.
                outcome.started = outcome.arrived = perf_counter()
                entry, doc, drop, put = self._parse(body.data, outcome)
                peer = ticket.take(entry, doc) or await ticket.admit(
                    entry, doc, outcome, receive, self._drain, self._load_wait_s
                )
                if entry.rename is not None:
                    # An alias: the upstream knows the model by its own name only.
                    put["model"] = entry.rename
                if outcome.translator is not None:
                    # Another API's request, sent as the chat completion it was translated to.
                    doc.update(put)
                    body.replace(orjson.dumps(doc))
                elif drop or put:
                    # Those members changed; every other byte is the client's.
                    body.replace(splice(body.data, doc.keys(), drop, put))
            except HTTPError as exc:
                outcome.refuse(exc)
            except ClientGone:
                outcome.gone_early = True
            else:
                if len(entry.peers) == 1:
                    # The document's strings are the body a second time: only the bytes go on.
                    del doc
                    await self._exchange.run(scope, receive, send, peer, body, outcome)
                else:
                    await self._run_on_set(scope, receive, send, ticket, entry, doc, body, outcome)
        finally:
            body.drop()
            # outcome.started: when its slot was taken (after any wait for it, or for a load).
            ticket.release(outcome.started)
        if outcome.refusal is not None:
            outcome.bytes_out = await refuse(
                send, outcome.endpoint.envelope, outcome.refusal, outcome.request_id, outcome.started
            )
        outcome.record(scope, self._metrics, self._access)

    @staticmethod
    def declines(data: bytes | bytearray, client: FastClient) -> bool:
        """Whether ``try_fast`` would decline a body at once: a stream, for a client the fast path
        relays no stream to, told from its bytes before any parse (the task path parses it once)."""
        return not client.streams and _asks_for_stream(data)

    def serves_head(self, scope: Scope, fields: HeadFields) -> bool:
        """Whether ``try_fast`` may take the request as far as its head tells (its body still
        coming; ``fields``: its head's walk): False where ``__call__`` refuses it at its head
        (405, 413, 415, or a declared length the budget has no room for) or the fast path never
        takes it."""
        return not (
            scope["method"] != "POST"
            or refuses_head(fields, self._max_body_bytes, self._body_budget)
            or self._drain.closing
            or self._total_timeout_s
        )

    def try_fast(
        self,
        scope: Scope,
        data: bytes | bytearray,
        client: FastClient,
        leave: Callable[[], None],
        fields: HeadFields,
        head_checked: bool = False,
    ) -> bool:
        """Begin the exchange of a request whose body ``data`` came whole, from the protocol's
        callback (``proxy/relay/fast.py``); False, having changed nothing, when it is not one
        the fast path serves (the caller runs the request as any other). ``fields``: its head,
        walked once (``proxy/relay/head.py``); ``head_checked``: its head passed ``serves_head``
        as it came (``check_head``'s rules are not applied again)."""
        budget = self._body_budget
        limit = self._max_body_bytes
        if not head_checked and (scope["method"] != "POST" or refuses_head(fields, limit, budget)):
            return False
        if (
            len(data) > limit
            or not budget.has_room(len(data))
            or self._drain.closing
            or self._total_timeout_s
        ):
            return False
        body = RequestBody(budget)
        outcome = Outcome(self.request_id_of.of(fields.request_id), ENDPOINTS[scope["path"]])
        try:
            entry, doc, drop, put = self._parse(data, outcome)
        except HTTPError:
            return False
        if (
            drop
            or put
            or (outcome.stream and not client.streams)
            or outcome.built is not None
            or entry.rename is not None
            or len(entry.peers) != 1
        ):
            return False
        peer = entry.peers[0]
        head = self._exchange.request_head(scope, peer, len(data), outcome.request_id, fields.forward)
        # None: no idle connection is pooled, and the exchange opens one (a burst's first requests).
        conn = peer.pool.take_idle()
        ticket = Ticket()
        if ticket.take(entry, doc) is not peer:
            ticket.release(perf_counter())
            if conn is not None:
                peer.pool.put_back(conn)
            return False
        del doc
        # Taken from here: nothing below fails (the budget had room, nothing ran since).
        body.hold(data)
        self._arrived(outcome)
        exchange = FastExchange(self, scope, client, outcome, ticket, body, peer, leave, self._head_timeout_s)
        if conn is None:
            exchange.connect(head)
        else:
            exchange.start(conn, head)
        return True

    async def resume(self, fast: FastExchange, scope: Scope, receive: Receive, send: Send) -> None:
        """Go on with an exchange the fast path began, as ``__call__`` would have from its send."""
        outcome = fast.outcome
        try:
            try:
                if fast.sent:
                    await self._exchange.resume(
                        fast.conn, fast.head, scope, receive, send, fast.peer, fast.body, outcome, sent=True
                    )
                else:
                    # Its connection could not be opened (answered as that failure), or the drain
                    # ended while it was: the exchange from its start.
                    await self._exchange.run(
                        scope, receive, send, fast.peer, fast.body, outcome, failed=fast.connect_failure
                    )
            finally:
                fast.body.drop()
                fast.ticket.release(outcome.started)
            outcome.record(scope, self._metrics, self._access)
        finally:
            fast.leave()

    def record(self, scope: Scope, outcome: Outcome) -> None:
        """Write a request's metrics and access-log line (``Outcome.record``)."""
        outcome.record(scope, self._metrics, self._access)

    async def _run_on_set(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ticket: Ticket,
        entry: RouteEntry,
        doc: dict[str, Any],
        body: RequestBody,
        outcome: Outcome,
    ) -> None:
        """The exchange with one of several replicas: one that could not be connected to is
        ejected and the request goes to another (it reached no engine), each tried once.

        A request that moved has each server it tried, in order, in its access-log line.
        """
        peer: Peer | None = ticket.peer
        tried: list[Peer] = []
        unsent: ConnectFailed | None = None
        while peer is not None:
            tried.append(peer)
            unsent = await self._exchange.run(scope, receive, send, peer, body, outcome, may_move=True)
            peer = None if unsent is None else ticket.move(entry, doc, tried)
        if unsent is not None:
            await self._exchange.refuse(send, outcome, unsent)  # no replica left to try
        if len(tried) > 1:
            outcome.upstreams = [p.addr for p in tried]

    def _parse(
        self, body: bytes | bytearray, outcome: Outcome
    ) -> tuple[RouteEntry, dict[str, Any], tuple[str, ...], dict[str, Any]]:
        """The request's route, its document, and the members to leave out and to set; 400 or 404.

        A request to an API its engine does not serve itself is translated: the document
        returned is the chat completion to send (``outcome.translator`` says so).
        """
        model, doc = parse_request(body)
        entry = self._entries.get(model)
        if entry is None:
            # Logged as the client gave it (made safe for the line); counted under no model's label.
            outcome.model = model
            raise _not_found(model, [route.model for route in self.table])
        outcome.model, outcome.stats = model, entry.stats
        endpoint = outcome.endpoint
        guards = entry.guards
        put: dict[str, Any] = {}
        if endpoint.api is not None:
            if endpoint.api in guards.native_apis:
                # Its server speaks the API: the client's bytes go through (but a cap).
                outcome.stream = doc.get("stream") is True
                _cap(doc, endpoint.max_tokens_field, guards.max_tokens, put)
                return entry, doc, (), put
            return self._translate(entry, endpoint, doc, outcome)
        target = endpoint.target
        # Nulls the engine cannot take: left out (OpenAI's null is the default).
        drop = check_request(doc, target, guards, entry.fields)
        outcome.stream = streamed = doc.get("stream") is True
        if guards.max_tokens is not None and endpoint.max_tokens_field is not None:
            _cap(doc, "max_tokens", guards.max_tokens, put)
            if doc.get("max_completion_tokens") is not None:
                _cap(doc, "max_completion_tokens", guards.max_tokens, put)
        # An engine that cannot tell that a non-stream client left is asked for a stream.
        if guards.via_stream and not streamed and ask_for_stream(doc, target, guards):
            outcome.built = ReplyAssembler(chat=endpoint is CHAT)
            put["stream"], put["stream_options"] = doc["stream"], doc["stream_options"]
        return entry, doc, drop, put

    def _translate(
        self, entry: RouteEntry, endpoint: Endpoint, doc: dict[str, Any], outcome: Outcome
    ) -> tuple[RouteEntry, dict[str, Any], tuple[str, ...], dict[str, Any]]:
        """The chat completion another API's request becomes, checked as any chat completion is."""
        assert endpoint.translate is not None
        translator = endpoint.translate(doc)
        chat = translator.chat_request()
        guards = entry.guards
        # An agent asks for more than a local model holds (Claude Code: 32000): the model's
        # max-tokens, else, where its context is known, half of it (the rest for the prompt).
        cap = guards.max_tokens
        if cap is None and guards.context_length is not None:
            cap = max(1, guards.context_length // 2)
        asked = chat.get("max_tokens")
        if cap is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked > cap):
            chat["max_tokens"] = cap
        try:
            dropped = check_request(chat, CHAT.target, guards, entry.fields)
        except HTTPError as exc:
            raise _renamed(exc, endpoint.renamed) from None
        for name in dropped:
            del chat[name]
        if translator.notes:
            log.info("%s %s: %s", outcome.request_id.decode(), endpoint.name, "; ".join(translator.notes))
        outcome.translator = translator
        outcome.stream = translator.stream
        return entry, chat, (), {}


def _asks_for_stream(data: bytes | bytearray) -> bool:
    """Whether a JSON body has a ``"stream"`` member set to ``true``, read from its bytes.

    The fast path serves no stream: a look for the member spares the parse the task path
    makes again. A ``"stream"`` elsewhere (a string's whole value) reads as no stream here,
    and the parse then says.
    """
    at = data.find(b'"stream"')
    while at >= 0:
        rest = data[at + 8 : at + 40].lstrip()
        if rest[:1] == b":" and rest[1:].lstrip()[:4] == b"true":
            return True
        at = data.find(b'"stream"', at + 8)
    return False


def _renamed(exc: HTTPError, renamed: Mapping[str, str]) -> HTTPError:
    """A refusal of a translated chat field, naming the field as the client's API calls it."""
    param = exc.param
    name = renamed.get(param) if param is not None else None
    if param is None or name is None:
        return exc
    message = name + exc.message[len(param) :] if exc.message.startswith(param) else exc.message
    return HTTPError(exc.status, message, code=exc.code, param=name, headers=exc.headers)


def _cap(doc: dict[str, Any], name: str | None, cap: int | None, put: dict[str, Any]) -> None:
    """Ask for at most ``cap`` tokens in ``name`` (and for ``cap`` where the request asks for none)."""
    if cap is None or name is None:
        return
    asked = doc.get(name)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked > cap:
        put[name] = cap


# The most model names a 404 lists (GET /v1/models has them all).
_NAMES_LISTED = 8


def _not_found(model: str, served: list[str]) -> HTTPError:
    if not served:
        known = "this gateway serves no model"
    elif len(served) <= _NAMES_LISTED:
        known = "the models served here: " + ", ".join(served)
    else:
        shown = ", ".join(served[:_NAMES_LISTED])
        known = f"the models served here: {shown} and {len(served) - _NAMES_LISTED} more"
    return HTTPError(
        404,
        f"The model `{echo(model)}` does not exist or is not served here; {known} "
        "(GET /v1/models lists them all)",
        param="model",
        code="model_not_found",
    )
