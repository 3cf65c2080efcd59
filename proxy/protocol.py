"""uvicorn's HTTP protocol (httptools), with the limits a public gateway needs.

- A request head must arrive whole within ``header_timeout_s`` of the
  connection opening or of its first byte (slowloris: a head sent a byte at a
  time, or a connection that sends nothing); past it, 408 and close.
- A request body must arrive whole within ``body_timeout_s`` of the end of
  its head (a head that declares a body and then sends nothing holds a
  descriptor and a task as a slow head does); past it, 408 and close.
- Request headers are bounded (``max_header_bytes``); past it, 431 and close.
- A protocol upgrade (``Connection: upgrade`` with ``Upgrade``) is refused
  with 400 and close: the gateway speaks HTTP/1.1 only, and the parser would
  otherwise stop at the head, dropping the body and holding the connection.
- Requests the parser refuses (e.g. both Content-Length and
  Transfer-Encoding) get uvicorn's 400 and close, but in OpenAI's envelope.
- As nginx does (RFC 9112): a request line of a version other than HTTP/1.0
  and HTTP/1.1 gets 505 (llhttp parses ``HTTP/2.0`` and ``HTTP/0.9`` and
  refuses other digits itself, answered 505 too); an HTTP/1.1 request
  without Host, or any with two, gets 400 (HTTP/1.0 may omit it); a
  Transfer-Encoding other than exactly ``chunked`` gets 501 (llhttp reads
  ``gzip, chunked`` as chunked, and passes the coded bytes on as the body),
  and one on an HTTP/1.0 request 400 (its framing is not to be trusted).
  Each closes the connection.
- An HTTP/1.0 client cannot read chunked framing (RFC 9112 6.1): a response
  of unknown length to it is close-delimited, no Transfer-Encoding, the
  close its end (``_CloseDelimitedCycle``, the cycle's ``send``; the
  writer below is not offered for it, so the relay goes through ``send``).
- Pipelined requests keep these limits and their order: a head that comes
  after a request ended in the same read is counted from httptools' pieces
  (the read's bytes were the earlier request's), and a head refused while
  earlier responses still go out is answered after them, then the close.

It also offers the relay an ASGI extension of its own,
``scope["extensions"]["blazar.writer"]``: given the ``send`` the app got, it
makes a ``ClientWriter`` that writes a relayed response straight to the
client's transport (None for a wrapped ``send``). The head goes out with
the first body bytes in one write, and each later piece in one call with no
message dict, no coroutine and no await unless the client's buffer is full.
It keeps uvicorn's response state (the cycle's own fields), so a response
may mix it with ASGI ``send``, and it keeps uvicorn's flow control. Once the
client's connection is closed or closing, its writes raise ``ClientGone``
(uvicorn's ``send`` drops them; the relay would count bytes nobody got). A
response written through ``send`` after such a close finds
``scope["extensions"]["blazar.gone"]`` set instead.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from proxy.errors import echo, error_body
from proxy.headers import check_header_bytes
from proxy.timers import for_loop
from proxy.unsent import UnsentWatch
from proxy.upstream_errors import ClientGone

# A body's bytes as one HTTP chunk, after what goes before it (a held head,
# or nothing); as the last one, with the end of the body.
CHUNK = b"%b%x\r\n%b\r\n"
LAST_CHUNK = b"%b%x\r\n%b\r\n0\r\n\r\n"
# The response fields whose values change how uvicorn frames or ends the response.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})


# A request line of a version other than 1.0 and 1.1 (llhttp parses 0.9, 1.0, 1.1 and 2.0).
_VERSION_REFUSAL = (
    505,
    "this HTTP version is not served here: send the request as HTTP/1.1 (or HTTP/1.0)",
    "http_version_not_supported",
)
# llhttp's word for a version it refuses itself (its error, as httptools raises it).
_LLHTTP_BAD_VERSION = "Invalid HTTP version"
# The response fields that give a body its length.
_LENGTHS = frozenset({b"content-length", b"transfer-encoding"})


# An ASGI app: what a fast path's hand-over runs in a task on the request's cycle.
App = Callable[[Any, Any, Any], Awaitable[None]]


def _nothing() -> None:
    pass


class ResponseWriter(Protocol):
    """What the fast path writes its answer with: ``ClientWriter``, or the lean protocol itself."""

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None: ...

    def respond(self, status: int, lines: list[bytes], body: bytes) -> None:
        """A whole response; ``lines``: fields a strict parser read (the upstream's head) or the
        gateway wrote, which the lean protocol does not check again."""


class FastClient(Protocol):
    """What a protocol gives the app's fast path for one request: ``Client`` here, or the lean
    protocol (``proxy/lean.py``) for the request it serves."""

    lost: Callable[[], None]
    # Whether the fast path may relay a stream to it (it is then a ``StreamClient``).
    streams: bool

    def writer(self) -> ResponseWriter: ...

    def run(self, app: App) -> None: ...

    def ended(self) -> None: ...

    def close(self) -> None: ...

    def watch(self) -> None: ...


class StreamWriter(Protocol):
    """What the fast path relays a stream with: the lean protocol itself."""

    def start(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool = False) -> None: ...

    def flush(self) -> None: ...

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None: ...

    def respond(self, status: int, lines: list[bytes], body: bytes) -> None: ...

    @property
    def write_paused(self) -> bool: ...


class StreamClient(FastClient, Protocol):
    """A ``FastClient`` whose ``streams`` is true: the fast path may relay a stream to it."""

    writable: Callable[[], None]

    def writer(self) -> StreamWriter: ...

    def abort(self) -> None: ...


class Client:
    """What the protocol gives the app's fast path (``proxy/relay/fast.py``) for one request."""

    __slots__ = ("_cycle", "_protocol", "lost")

    # Its streams are the task path's (``ClientWriter``).
    streams = False

    def __init__(self, protocol: GatewayProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol = protocol
        self._cycle = cycle
        # Told that the client's connection was lost; set by the exchange, while it runs.
        self.lost: Callable[[], None] = _nothing

    def writer(self) -> ClientWriter:
        """The writer of this request's response (the server's own, to its transport)."""
        return ClientWriter(self._cycle)

    def run(self, app: App) -> None:
        """Run ``app`` for this request in a task, on its cycle (the hand-over)."""
        HttpToolsProtocol._start_asgi_task(self._protocol, self._cycle, app)

    def ended(self) -> None:
        """The exchange is no longer the fast path's (answered, or handed over)."""
        self.lost = _nothing  # no reference back to the exchange: no cycle for the collector
        self._protocol._fast_client = None

    def close(self) -> None:
        """Close the client's connection (a response that could not be written)."""
        protocol = self._protocol
        protocol.transport.close()
        protocol.watch_unsent()  # the close waits for what the client has not taken

    def watch(self) -> None:
        """Read the client's connection again, as ``receive`` does when a relay waits on it: its
        close is then seen (a large body or a pipelined head paused the reading)."""
        cycle = self._cycle
        if not cycle.disconnected and not cycle.response_complete:
            self._protocol.flow.resume_reading()


logger = logging.getLogger("blazar.server")


# Requests read ahead behind the one being served, at most: reading stops there until they are served.
MAX_PIPELINED = 16


class _BoundedFlow(FlowControl):
    """uvicorn's flow control, reading no further while ``MAX_PIPELINED`` requests wait their turn.

    uvicorn pauses reading as a request is queued behind the running one, but reads on wherever
    something asks it to (a response's end, an app's ``receive``, the relay's watch of the client):
    each time, a read's worth of requests (hundreds of small ones) joins the queue, and a client
    that writes requests faster than they are answered grows it without end. Past the bound the
    rest wait in the socket, as they would for nginx.
    """

    def __init__(self, transport: asyncio.Transport, pipeline: Any) -> None:
        super().__init__(transport)
        self._pipeline = pipeline

    def resume_reading(self) -> None:
        if len(self._pipeline) < MAX_PIPELINED:
            super().resume_reading()


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; ``send_400_response`` answers for it."""


class GatewayProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # Raw bytes of the request head so far: httptools builds a whole
        # header value (or URL) before any callback, so counting there is late.
        self._head_bytes = 0
        self._in_head = True
        # A head has begun (its first bytes are in) and is not yet whole.
        self._head_begun = False
        self._refusal: tuple[int, str, str] | None = None
        # A pipelined head refused while an earlier response still goes out: sent once it has ended.
        self._after_response: tuple[int, str, str] | None = None
        # A request ended in this read: the bytes after it (the next head's) were not counted.
        self._uncounted = False
        # The head being read began in such a read: its size is checked whole at its end.
        self._head_uncounted = False
        self._extensions: dict[str, Any] = {}
        # Pipelined requests still running behind uvicorn's newest cycle.
        self._earlier: list[RequestResponseCycle] = []
        # The wait for the next request on a kept-alive connection: a coarse timer (proxy/timers.py).
        self._timers = for_loop(self.loop)
        self._keep_alive_timer: int | None = None
        # The request's Host fields, and its Transfer-Encoding values joined (None: none).
        self._hosts = 0
        self._codings: bytes | None = None
        # The relay's fast path (proxy/relay/fast.py), where the app offers one: a POST to one of
        # its paths waits, untasked, for its body's end in this read; offered to ``fast`` then.
        self._fast: Callable[[Any, bytearray, Client], bool] | None = getattr(self.app, "fast", None)
        self._fast_paths: frozenset[str] = getattr(self.app, "fast_paths", frozenset())
        self._deciding = False
        self._deferred: tuple[RequestResponseCycle, Any] | None = None
        # The request the fast path is serving on this connection, while it serves it.
        self._fast_client: Client | None = None
        # A request not begun while the client takes no answers (``_start_asgi_task``).
        self._held: tuple[RequestResponseCycle, Any] | None = None
        self._send_stall_s: float = getattr(self.app, "send_stall_s", 0.0)
        self._handing_over = False
        self._unsent: UnsentWatch | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _BoundedFlow(transport, self.pipeline)
        self._unsent = UnsentWatch(self.loop, transport, self._send_stall_s, self._responding)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        if self._unsent is not None:
            self._unsent.cancel()
            self._unsent = None  # it refers to this protocol: freed without the collector
        held, self._held = self._held, None
        if held is not None:
            # Never begun, so uvicorn never let go of its callback to this protocol.
            held[0].on_response = _nothing
        super().connection_lost(exc)
        # uvicorn tells only its newest cycle; a pipelined request behind a
        # running one would leave that one writing to a closed connection and
        # its engine generating for nobody.
        for cycle in self._earlier:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
                cycle.scope["extensions"]["blazar.gone"] = True  # type: ignore[assignment]
        self._earlier.clear()
        if self.cycle is not None and not self.cycle.response_complete:
            # For a response written through ASGI send, which drops what comes after
            # silently: the relay's writer asks, so that its record says what was sent.
            self.cycle.scope["extensions"]["blazar.gone"] = True  # type: ignore[assignment]
        if self._fast_client is not None:
            # The exchange closes its upstream, as the task path's watcher would.
            self._fast_client.lost()

    def data_received(self, data: bytes) -> None:
        if self._after_response is not None:
            # A head was refused; the connection closes after the responses before it.
            # What comes meanwhile (reading resumes when their apps await receive) is dropped.
            return
        if self._in_head:
            # Counted on raw bytes as they arrive: httptools builds a whole header
            # value (or URL) before any callback, so counting there is too late.
            self._head_bytes += len(data)
        self._uncounted = False
        super().data_received(data)
        if self._deferred is not None:
            # Its body did not end in this read: served as any request.
            cycle, app = self._deferred
            self._deferred = None
            HttpToolsProtocol._start_asgi_task(self, cycle, app)
        if self.transport.is_closing() or self._after_response is not None:
            return
        if self._uncounted and self._in_head and self._head_begun:
            # A pipelined head began after a request that ended in this read: what
            # httptools has given of it so far (it holds a header still arriving),
            # at least its first byte; and its size is checked whole at its end.
            self._head_bytes = max(self._head_size(), 1)
            self._head_uncounted = True
        # The timers are armed only for what is still incomplete after a read:
        # a request that arrives whole in one read (nearly all do) arms none.
        if not self._in_head:
            # In a body: it must end within body_timeout_s of its head's end, or of
            # its turn (a pipelined request waits, unread, behind the one running).
            if self._body_timer is None and not self._queued():
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
        elif self._head_bytes > self.max_header_bytes:
            self._refuse_in_turn(
                431, f"request headers are larger than {self.max_header_bytes} bytes", "headers_too_large"
            )
        elif self._head_begun and self._head_timer is None:
            self._arm_head_timer()

    def replay(self, data: bytes, offer: Callable[[Any, bytearray, Client], bool] | None) -> None:
        """Read ``data``, the bytes of a connection another protocol had (``proxy/lean.py``), from
        the first byte of the request it was reading; ``offer`` stands for the app's fast path for
        that request (None: it is not offered, and runs as a task)."""
        fast = self._fast
        self._fast = offer
        # A request the lean protocol's fast path served and hands over goes on now, written or
        # not, as it would have there (its exchange waits on the client's buffer as it writes).
        self._handing_over = offer is not None
        try:
            self.data_received(data)
        finally:
            self._handing_over = False
            if self._fast is offer:
                self._fast = fast

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The client's abort, for the relay to cut a client that stopped
        # reading, and the writer's maker (uvicorn's scope has no extensions
        # of its own). The maker, not a writer: a writer holds its cycle, and
        # the cycle holds this scope, a reference cycle per request that only
        # the collector would free (a gen 0 collection every ~50 requests).
        self.scope["extensions"] = self._extensions = {
            "blazar.abort": self.transport.abort,
            "blazar.writer": ClientWriter.of,
        }
        self._head_begun = True
        self._hosts = 0
        self._codings = None

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's (the names lower-cased, Expect noted), with Host and
        # Transfer-Encoding counted: a compare or two a header.
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        elif name == b"transfer-encoding":
            self._codings = value if self._codings is None else self._codings + b", " + value
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _take_authority(self) -> None:
        try:
            target = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # uvicorn's own parse of the target refuses it with a 400
        if target.host is None:
            return
        host = b"[" + target.host + b"]" if b":" in target.host else target.host
        authority = host if target.port is None else b"%s:%d" % (host, target.port)
        # In place: the scope holds this list.
        self.headers[:] = [(n, authority if n == b"host" else v) for n, v in self.headers]

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._head_begun = False
        # A head that arrived whole in one read: check its size here (only when
        # the raw bytes read so far, head and maybe body, pass the limit, or
        # when it came after a request that ended in the same read).
        if (self._head_bytes > self.max_header_bytes or self._uncounted or self._head_uncounted) and (
            self._head_size() > self.max_header_bytes
        ):
            self._refusal = (
                431,
                f"request headers are larger than {self.max_header_bytes} bytes",
                "headers_too_large",
            )
            raise _Refused()
        version = self.parser.get_http_version()
        if version != "1.1" and version != "1.0":
            self._refusal = _VERSION_REFUSAL
            raise _Refused()
        if self._hosts != 1 and (self._hosts or version != "1.0"):
            self._refusal = (
                400,
                "the request has two Host header fields; send one"
                if self._hosts
                else "an HTTP/1.1 request needs a Host header field; send one",
                "invalid_host_header",
            )
            raise _Refused()
        if self.url[:1] != b"/" and self._hosts:
            # The absolute form (RFC 9112 §3.2.2): the target's authority names the
            # host, and the Host field is ignored; uvicorn drops the authority, so the
            # checks of the Host field (proxy/browser.py) are given it in its place.
            self._take_authority()
        if self._codings is not None:
            self._refusal = _coding_refusal(self._codings, version)
            if self._refusal is not None:
                raise _Refused()
        # llhttp's own flag first (a C call): our check only for a head it marks as an upgrade.
        if self.parser.should_upgrade() and _asks_upgrade(self.headers):
            self._refusal = (
                400,
                "protocol upgrades are not served here (the request has Connection: upgrade); "
                "send it as plain HTTP/1.1, without Upgrade",
                "upgrade_not_supported",
            )
            raise _Refused()
        self._in_head = False
        earlier = self.cycle
        self._deciding = True
        try:
            super().on_headers_complete()
        finally:
            self._deciding = False
        if version == "1.0":
            # Its task has not run yet: its first step finds this class's send.
            self.cycle.__class__ = _CloseDelimitedCycle
        if earlier is not None and earlier is not self.cycle and not earlier.response_complete:
            # Pipelined: the earlier request still runs; see connection_lost.
            self._earlier = [c for c in self._earlier if not c.response_complete]
            self._earlier.append(earlier)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        super().on_message_complete()
        # The next bytes on this connection begin the next request's head; any
        # left in this read were counted as this request's.
        self._in_head = True
        self._head_bytes = 0
        self._uncounted = True
        self._head_uncounted = False
        if self._deferred is not None:
            self._offer_fast()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self.flow.write_paused and not self._handing_over:
            # The client has not taken the answers before this one (its buffer is over the
            # high-water mark): served once it does (``resume_writing``), not answered into a
            # buffer that a client which never reads would grow without end. One at most: those
            # after it queue behind it, unread past ``MAX_PIPELINED``.
            self._held = (cycle, app)
            self.flow.pause_reading()
            return
        # A POST to a fast path, as its head ends (not a pipelined one started later): its
        # task waits for the body's end (``on_message_complete``, or the end of this read).
        if self._deciding and self._fast is not None and app is self.app:
            scope = cycle.scope
            if (
                scope["method"] == "POST"
                and scope["path"] in self._fast_paths
                and scope["http_version"] == "1.1"
                and not self.expect_100_continue
            ):
                self._deferred = (cycle, app)
                return
        super()._start_asgi_task(cycle, app)

    def _offer_fast(self) -> None:
        """Offer the request whose body has just ended to the relay's fast path; else start its task."""
        assert self._deferred is not None and self._fast is not None
        cycle, app = self._deferred
        self._deferred = None
        if cycle is self.cycle and not cycle.disconnected:
            data = cycle.body
            # Its body is taken as ``receive`` would take it: what the task's receive
            # gives after a hand-over is the disconnect, as after a relay's read.
            cycle.body = bytearray()
            cycle.message_event.clear()
            client = Client(self, cycle)
            try:
                taken = self._fast(cycle.scope, data, client)
            except Exception:
                # Nothing is taken before the last step that can fail: served as any request.
                logger.exception("the relay's fast path failed; the request is served as any other")
                taken = False
            if taken:
                self._fast_client = client
                # As the relay's read of the body would (``receive``): a large body paused reading.
                self.flow.resume_reading()
                return
            cycle.body = data
            cycle.message_event.set()
        HttpToolsProtocol._start_asgi_task(self, cycle, app)

    def _responding(self) -> bool:
        """Whether a response is being written (begun, not held, not complete)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and self._held is None

    def on_response_complete(self) -> None:
        # uvicorn's, with its keep-alive wait on a coarse timer.
        self.server_state.total_requests += 1
        self.watch_unsent()
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self._after_response is not None:
            # A pipelined head was refused behind the responses before it.
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._reply_and_close(*self._after_response)
            return
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self.flow.resume_reading()  # with one fewer queued (``MAX_PIPELINED``)
            self._start_asgi_task(cycle, app)
        else:
            self.flow.resume_reading()
            handler = self.timeout_keep_alive_handler
            self._keep_alive_timer = self._timers.later(self.timeout_keep_alive, handler)
        # A queued request whose body is still coming has its turn now (uvicorn started it).
        if (
            not self._in_head
            and self._body_timer is None
            and not self._queued()
            and not self.transport.is_closing()
        ):
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's own keep-alive timer is armed only in the on_response_complete replaced above.
        if self._keep_alive_timer is not None:
            self._timers.cancel(self.timeout_keep_alive, self._keep_alive_timer)
            self._keep_alive_timer = None

    def _queued(self) -> bool:
        """Whether the request being read waits behind a running one (pipelined), or for the
        client to take the answers before it."""
        held = self._held
        return (held is not None and held[0] is self.cycle) or any(
            cycle is self.cycle for cycle, _ in self.pipeline
        )

    def resume_writing(self) -> None:
        super().resume_writing()
        held = self._held
        if held is not None and not self.transport.is_closing():
            self._held = None
            self._start_asgi_task(*held)
            if not self._in_head and self._body_timer is None and held[0] is self.cycle:
                # Its body, still coming, is due from its turn, as a pipelined one's.
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def send_400_response(self, msg: str) -> None:
        if self._after_response is not None:
            return  # the parser has failed already: its refusal waits for its turn
        refusal = self._refusal
        if refusal is None and str(sys.exception()) == _LLHTTP_BAD_VERSION:
            # Called from uvicorn's handler of the parser's error: a version llhttp does not parse.
            refusal = _VERSION_REFUSAL
        status, message, code = refusal or (400, f"invalid HTTP request: {msg}", "invalid_request")
        if self._in_head:
            self._refuse_in_turn(status, message, code)
        elif self._held is not None and self._held[0] is self.cycle:
            # The broken body is a held request's (``_start_asgi_task``): it never starts, and
            # nothing runs before it, so it is answered now.
            self._held = None
            self._reply_and_close(status, message, code)
        elif self._queued():
            # The broken body is a queued request's: it never starts, and gets this in its turn.
            queued = self.cycle
            kept = [entry for entry in self.pipeline if entry[0] is not queued]
            self.pipeline.clear()  # in place: the flow control counts this deque
            self.pipeline.extend(kept)
            self._refuse_in_turn(status, message, code)
        else:
            # The running request's own body broke: it is answered now, and the connection closed.
            self._reply_and_close(status, message, code)

    def _refuse_in_turn(self, status: int, message: str, code: str) -> None:
        """Refuse the request being read: now, or after the responses of the requests before it."""
        if self.cycle is not None and not self.cycle.response_complete:
            # Requests before this head still run: their responses go out first.
            self._after_response = (status, message, code)
            self.flow.pause_reading()
            return
        self._reply_and_close(status, message, code)

    def _head_size(self) -> int:
        """The head's bytes as httptools has given them so far: the URL and the header lines."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            # No request under way: an idle or silent connection, or a head in progress.
            self._reply_and_close(
                408, f"the request head did not arrive within {self.header_timeout_s:g} s", "request_timeout"
            )
        elif self._in_head and self._head_bytes:
            # A pipelined head trickling in behind a running request: check again later.
            self._arm_head_timer()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        self._reply_and_close(
            408, f"the request body did not arrive within {self.body_timeout_s:g} s", "request_timeout"
        )

    def _reply_and_close(self, status: int, message: str, code: str) -> None:
        if self.transport.is_closing():
            return
        body = error_body(status, message, code=code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nconnection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(head))
        self.transport.close()
        self.watch_unsent()  # the close waits for what the client has not taken

    def watch_unsent(self) -> None:
        """Watch what the client has not taken of the responses so far (``UnsentWatch``)."""
        if self._unsent is not None:
            self._unsent.arm()


class _CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle: a response of unknown length is sent as it comes, the close its end.

    uvicorn would frame it chunked, which an HTTP/1.0 client reads as part of
    the body. A response with a length (or HEAD, 204, 304) is uvicorn's.
    """

    close_delimited = False

    async def send(self, message: Any) -> None:
        if not self.response_started:
            if (
                message["type"] == "http.response.start"
                and message["status"] not in (204, 304)
                and self.scope["method"] != "HEAD"
                and not any(name.lower() in _LENGTHS for name, _ in message.get("headers", ()))
            ):
                # Not chunked (uvicorn adds no Transfer-Encoding), and closed at the end.
                self.chunked_encoding = False
                self.keep_alive = False
                self.close_delimited = True
        elif self.close_delimited and not self.response_complete and message["type"] == "http.response.body":
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            body = message.get("body", b"")
            if body:
                self.transport.write(body)
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()
                self.transport.close()
                self.on_response()
            return
        await super().send(message)


class ClientWriter:
    """A response written straight to the client's transport, in uvicorn's cycle's own state.

    ``start`` holds the head; the first ``write`` (or ``flush``) sends it, with
    the body bytes in the same write. ``write`` returns None when the bytes are
    handed to the transport, or an awaitable to wait on while the client's
    buffer is above its high-water mark (the relay awaits it: backpressure).
    Once the client's connection is closed or closing, ``write`` and ``flush``
    raise ``ClientGone`` (uvicorn's ``send`` drops the bytes silently): the
    bytes the relay counts are the bytes handed to the client's transport.
    """

    __slots__ = ("_cycle", "_head", "_send")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._send = cycle.send
        self._head: bytes | None = None

    @staticmethod
    def of(send: object) -> ClientWriter | None:
        """The writer of the response whose ASGI ``send`` this is: uvicorn's own, not a wrapper's (None)."""
        if getattr(send, "__func__", None) is not RequestResponseCycle.send:
            return None  # a wrapper (CORS) adds headers that only send would see
        cycle: RequestResponseCycle = send.__self__  # type: ignore[attr-defined]
        return ClientWriter(cycle)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The response head, held until the first body bytes (or ``flush``)."""
        cycle = self._cycle
        if cycle.response_started:
            raise RuntimeError("the response has already started")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        close = False
        for name, value in (*cycle.default_headers, *headers):
            if name in _FRAMING:
                if name == b"content-length":
                    if cycle.chunked_encoding is None:
                        cycle.expected_content_length = int(value)
                        cycle.chunked_encoding = False
                elif name == b"transfer-encoding":
                    if value.lower() == b"chunked":
                        cycle.expected_content_length = 0
                        cycle.chunked_encoding = True
                elif b"close" in value.lower():
                    cycle.keep_alive = False
                    close = True
            content += (name, b": ", value, b"\r\n")
        check_header_bytes(content)
        if not cycle.keep_alive and not close:
            content.append(b"connection: close\r\n")
        if cycle.chunked_encoding is None and status not in (204, 304):
            cycle.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._head = b"".join(content)

    def respond(self, status: int, lines: list[bytes], body: bytes) -> None:
        """A whole response: ``start`` with the fields of ``lines`` (name, ``": "``, value, CRLF
        a field), then ``body`` as its last ``write``."""
        self.start(status, list(zip(lines[0::4], lines[2::4], strict=True)))
        self.write(body, False)

    def flush(self) -> Awaitable[None] | None:
        """Send a held head on its own (the body's first bytes are not there yet)."""
        head = self._head
        if head is None:
            return None
        self._head = None
        cycle = self._cycle
        if cycle.disconnected or cycle.transport.is_closing():
            raise ClientGone("the client's connection closed before the response began", nothing_sent=True)
        cycle.transport.write(head)
        return cycle.flow.drain() if cycle.flow.write_paused else None

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None:
        """Send body bytes (the last of the response when not ``more``), after a held head."""
        cycle = self._cycle
        if cycle.disconnected or cycle.transport.is_closing():
            if cycle.response_complete:
                return None
            # The client's connection is closed or closing (a half-close closes it):
            # nothing more reaches it, and the relay must stop and say so.
            raise ClientGone("the client's connection closed", nothing_sent=self._head is not None)
        if cycle.response_complete:
            return None
        head = self._head
        if head is None:
            head = b""
        else:
            self._head = None
        if cycle.chunked_encoding:
            if body:
                # One copy of the body: a held head and the framing in the same format.
                data = (CHUNK if more else LAST_CHUNK) % (head, len(body), body)
            else:
                data = head if more else head + b"0\r\n\r\n"
        else:
            cycle.expected_content_length -= len(body)
            if cycle.expected_content_length < 0:
                raise RuntimeError("Response content longer than Content-Length")
            data = head + body if head else body
        if data:
            cycle.transport.write(data)
        if not more:
            if cycle.expected_content_length != 0 and not cycle.chunked_encoding:
                raise RuntimeError("Response content shorter than Content-Length")
            cycle.response_complete = True
            cycle.message_event.set()
            if not cycle.keep_alive:
                cycle.transport.close()
            cycle.on_response()
            return None
        return cycle.flow.drain() if cycle.flow.write_paused else None


def _coding_refusal(codings: bytes, version: str) -> tuple[int, str, str] | None:
    """What a request's Transfer-Encoding gets, as nginx answers it: None for ``chunked`` alone.

    llhttp refuses a coding list that does not end with chunked, and chunked
    named twice; it reads ``gzip, chunked`` as chunked, passing on the coded
    bytes, and the relay cannot decode them.
    """
    if version == "1.0":
        return (
            400,
            "an HTTP/1.0 request cannot use Transfer-Encoding; send the body with Content-Length",
            "invalid_transfer_encoding",
        )
    if codings.strip().lower() == b"chunked":
        return None
    return (
        501,
        f"the request's Transfer-Encoding {echo(codings.decode('latin-1'))!r} is not supported: "
        "send the body with Content-Length, or with Transfer-Encoding: chunked alone",
        "unsupported_transfer_encoding",
    )


def _asks_upgrade(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a head asks to switch protocols: an Upgrade field that Connection names."""
    upgrade = connection = False
    for name, value in headers:
        if name == b"upgrade":
            upgrade = True
        elif name == b"connection" and b"upgrade" in value.lower():
            connection = True
    return upgrade and connection


def protocol_class(
    header_timeout_s: float, max_header_bytes: int, body_timeout_s: float = 60.0
) -> type[GatewayProtocol]:
    """The protocol with these limits, as uvicorn's `http` setting takes a class."""
    return type(
        "GatewayProtocol",
        (GatewayProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "max_header_bytes": max_header_bytes,
            "body_timeout_s": body_timeout_s,
        },
    )
