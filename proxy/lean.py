"""The client's connection while its requests are the relay's common case: httptools, nothing more.

uvicorn's protocol (``proxy/protocol.py``'s ``GatewayProtocol``) builds an
ASGI scope, a request-response cycle and an ``asyncio.Event`` for every
request, and runs a dozen Python callbacks of its own and ours around the
parser, before the relay's fast path (``proxy/relay/fast.py``) is offered
the request. ``LeanProtocol`` serves a connection while each request on it
is one that fast path may take, with the parser's callbacks only:

- a head whole in one read, and its body in that read or the next ones
  (httpx, under the OpenAI and Anthropic SDKs, writes them apart), within
  ``body_timeout_s`` of the head, and nothing after it (no pipelining); the
  whole request within ``max_header_bytes``. A head whose body is still
  coming is first shown to the app's ``serves_head``: one it would refuse at
  its head (a browser check, a key, a declared length the body budget has
  no room for) goes to the full protocol at once, which refuses it there as
  it always has. The body's bytes then hold the app's ``body_budget``
  (``proxy/relay/request.py``) as they come, as the full protocol's request
  would; bytes that do not fit go to the full protocol (its 503);
- ``POST`` to one of the app's ``fast_paths`` (the path exactly: no query,
  no escape, not the absolute form), HTTP/1.1, one Host field, a body
  framed by Content-Length, no Expect, Upgrade or Transfer-Encoding.

Such a request is offered to the app's ``fast`` with a small scope of its
own (no extensions: ``blazar.gone`` and the writer are the full protocol's),
and this protocol is its ``FastClient``. Its answer is written in one write;
a stream's (``streams``), chunked, as its events come (``write`` with
``more``), the exchange told when the client takes bytes again after its
buffer passed the high-water mark (``writable``), or dropped at once when it
takes none (``abort``).

Anything else, and anything the fast path declines, passes the connection
to the full protocol for the rest of its life: it is made as uvicorn
would make it, given the transport, and fed the bytes of the request being
read from its first byte (and any read after it). The full protocol then
serves it as if it had had the connection from the start: its head and body
deadlines, its limits and refusals, pipelining, ASGI tasks. A request the
fast path took and then hands over (an upstream error, a head of another
kind, the client's connection lost) is replayed the same way, and the full protocol
runs the hand-over's task on it with its body taken, as it would have.

A connection that sends nothing is answered 408 after ``header_timeout_s``,
and a body that does not come after ``body_timeout_s`` (each by the full
protocol's own reply; a first head or a body passed to it is due when it
was due here); a connection idle after a response is closed after uvicorn's
``timeout_keep_alive``, on one timer a connection. A client that leaves, or
a shutdown, while a body is still coming passes its request to the full
protocol, which serves and records it as it would have.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final, Protocol

import httptools
from mypy_extensions import mypyc_attr
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from proxy import outbox
from proxy.headers import check_header_bytes
from proxy.protocol import (
    CHUNK,
    LAST_CHUNK,
    App,
    FastClient,
    GatewayProtocol,
    protocol_class,
)
from proxy.unsent import UnsentWatch
from proxy.upstream_errors import ClientGone

logger: Final = logging.getLogger("blazar.server")

# Header fields whose presence sends the request to the full protocol.
_ODD: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade"})


class BodyBudget(Protocol):
    """The app's budget of request-body bytes held at once (``proxy/relay/request.py``)."""

    def take(self, size: int) -> bool: ...

    def give_back(self, size: int) -> None: ...


def _nothing() -> None:
    pass


# ``server_protocol`` makes a subclass of it at run time: compiled (``proxy/compiled.py``), a class
# must be marked for that.
@mypyc_attr(allow_interpreted_subclasses=True)
class LeanProtocol(asyncio.Protocol):
    """An HTTP/1.1 server connection for the relay's common case; the full protocol for the rest."""

    # The full protocol, with the same limits (``server_protocol`` sets them: class attributes,
    # which a subclass's own replace).
    full: ClassVar[type[GatewayProtocol]] = GatewayProtocol
    header_timeout_s: ClassVar[float] = 10.0
    max_header_bytes: ClassVar[int] = 64 * 1024
    body_timeout_s: ClassVar[float] = 60.0

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = _loop or asyncio.get_event_loop()
        app = config.loaded_app
        self._fast: Callable[[Any, bytes | bytearray, FastClient], bool] | None = getattr(app, "fast", None)
        if config.root_path or config.limit_concurrency is not None:
            self._fast = None  # uvicorn's own handling of those, in the full protocol
        self._fast_paths = {path.encode(): path for path in getattr(app, "fast_paths", ())}
        self._serves_head: Callable[[Any], bool] | None = getattr(app, "serves_head", None)
        # ``fast`` for a request whose head ``serves_head`` passed before its body came (the app
        # does not check that head again); ``fast`` itself where the app has no such method.
        self._fast_after_head: Callable[[Any, bytes | bytearray, FastClient], bool] | None = (
            getattr(app, "fast_after_head", None) if self._serves_head is not None else None
        )
        self._budget: BodyBudget | None = getattr(app, "body_budget", None)
        self._send_stall_s: float = getattr(app, "send_stall_s", 0.0)
        self._unsent: UnsentWatch | None = None
        self._keep_alive_s: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int | None] | None = None
        self.scheme = "http"
        # The fields of each request's scope that are the connection's (``_scope_of``).
        self._scope_base: dict[str, Any] = {}
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: bytes | bytearray = b""
        self._hosts = 0
        self._odd = False
        self._ended = False
        self._again = False
        self._head_done = False
        # The bytes of a request whose head is whole and body still coming, its scope, and deadline.
        self._raw = bytearray()
        self._scope: dict[str, Any] = {}
        self._body_timer: asyncio.TimerHandle | None = None
        # What the body's bytes held so far are charged to the budget.
        self._charged = 0
        # The request the fast path serves: its bytes (for a hand-over), and what came after it.
        self._busy = False
        self._data = b""
        self._pending = b""
        self._paused = False
        self._keep_alive = True
        self._head: bytes | None = None
        # A whole answer, written at the end of the loop's pass (``proxy/outbox.py``): held till then.
        box = outbox.for_loop(self.loop)
        self._due, self._flush_due = box.due, box.flush
        self._out: bytes | None = None
        # The response under way is a stream, framed chunked (``start``'s ``chunked``).
        self._chunked = False
        # Told that the client's connection was lost; set by the exchange, while it runs.
        self.lost: Callable[[], None] = _nothing
        # Told that the client takes bytes again (its buffer below the low-water mark): a stream's.
        self.writable: Callable[[], None] = _nothing
        # The deadline of a connection's first head, and the idle connection's (one per connection).
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        # The connection's first head must be whole by then (0: a request has been served).
        self._first_deadline = 0.0
        # The transport's buffer is over its high-water mark (told to the full protocol at a switch).
        self._write_paused = False
        # Set once the full protocol has the connection.
        self._full: GatewayProtocol | None = None
        # The server's shutdown came while a request was served: the full protocol, should it be
        # given that request, is told (the server tells each connection once).
        self._shut_down = False

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        if self._fast is None:
            self._switch(b"")
            return
        self.server_state.connections.add(self)
        self._unsent = UnsentWatch(self.loop, transport, self._send_stall_s, self._serving)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
        self._scope_base = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "scheme": self.scheme,
            "path": "",
            "raw_path": b"",
            "query_string": b"",
            "root_path": "",
            "headers": [],
            "client": self.client,
            "server": self.server,
        }
        self._first_deadline = self.loop.time() + self.header_timeout_s
        self._head_timer = self.loop.call_at(self._first_deadline, self._silent)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._out = None
        self._cancel_timers()
        if self._raw:
            # A body was still coming: the full protocol's request, told of the loss as it would be.
            self._switch(self._raw)
        if self._busy:
            # The exchange closes its upstream and hands the request over: to the full protocol,
            # which is then told of the loss as it would have been.
            self.lost()
        full = self._full
        if full is not None:
            full.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._busy:
            # A request behind the one being served: read once that one is answered.
            self._pending += data
            if len(self._pending) > self.max_header_bytes and not self._paused:
                self._paused = True
                self.transport.pause_reading()
            return
        if self._write_paused:
            # The client has not taken the answers before this request (its buffer is over the
            # high-water mark): read once it does (``resume_writing``), not answered into a buffer
            # that a client which never reads would grow without end. In, so not idle.
            self._pending += data
            self._idle_since = 0.0
            if not self._paused:
                self._paused = True
                self.transport.pause_reading()
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._pending:
            # Read after an answer, before the bytes that waited behind it were: theirs come first.
            data = self._pending + data
            self._pending = b""
        # The request's bytes from its first: with those of earlier reads whose body was still coming.
        if self._raw:
            self._raw += data  # a bytearray: appended in place, not copied whole each read
            raw: bytes | bytearray = self._raw
        else:
            raw = data
        if len(raw) > self.max_header_bytes:
            self._switch(raw)
            return
        self._idle_since = 0.0
        if not self._raw:
            self._ended = self._again = self._odd = self._head_done = False
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._switch(raw)  # the full protocol's refusal, in its words
            return
        parser = self.parser
        path = self._fast_paths.get(self._url)
        if (
            not self._head_done
            or self._again
            or self._odd
            or path is None
            or self._hosts != 1
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
        ):
            self._switch(raw)
            return
        if not self._ended:
            # The head is whole, the body still coming (clients that write them apart: httpx):
            # read on, within the body's deadline, as the full protocol would.
            if not self._raw:
                scope = self._scope = self._scope_of(path)
                if self._serves_head is not None and not self._serves_head(scope):
                    self._switch(raw)  # refused at its head, or never the fast path's
                    return
                self._raw = bytearray(raw)
            if not self._hold_body():
                self._switch(self._raw)  # the full protocol's 503, as it refuses one
                return
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
            return
        fast = self._fast
        assert fast is not None  # without it the full protocol has the connection from its start
        if self._raw:
            data = bytes(raw)
            self._raw = bytearray()
            self._cancel_body_timer()
            self._give_back()  # charged again by the fast path, or by the request the full protocol runs
            scope, self._scope = self._scope, {}
            if self._fast_after_head is not None:
                fast = self._fast_after_head  # its head was shown to ``serves_head`` as it came
        else:
            scope = self._scope_of(path)
        body, self._body = self._body, b""
        self._busy = True
        try:
            taken = fast(scope, body, self)
        except Exception:
            # Nothing is taken before the last step that can fail: served as any request.
            logger.exception("the relay's fast path failed; the request is served as any other")
            taken = False
        if taken:
            self._data = data
            self._first_deadline = 0.0
        else:
            self._busy = False
            self._switch(data)

    def _scope_of(self, path: str) -> dict[str, Any]:
        """The request's scope, for the app: what the fast path reads of it (the connection's
        fields copied, a C copy of one table, and the request's own set)."""
        scope = self._scope_base.copy()
        scope["path"] = path
        scope["raw_path"] = self._url
        scope["headers"] = self._headers
        return scope

    def eof_received(self) -> None:
        # The transport closes (connection_lost), after what was written before: a held answer too.
        self._write_out()

    def pause_writing(self) -> None:
        # Told to a stream by ``write_paused``; to the full protocol at a switch.
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self.writable()
        if self._pending and not self._busy and self._full is None:
            self.loop.call_soon(self._next)  # a request that waited for the client to read

    def shutdown(self) -> None:
        """The server's graceful shutdown: close now, or after the response under way."""
        if self._raw:
            self._switch(self._raw).shutdown()  # a body still coming: the full protocol's request
        elif self._busy:
            self._keep_alive = False
            self._shut_down = True
        elif self._pending:
            # A request held while the client takes no answers: the full protocol serves it, with
            # ``connection: close``, once the client reads (as it serves one it holds).
            self._switch(b"").shutdown()
        else:
            self._write_out()
            self.transport.close()

    # -- httptools callbacks -------------------------------------------------

    def on_message_begin(self) -> None:
        if self._ended:
            self._again = True  # a second request in the read: the full protocol pipelines it
            return
        self._url = b""
        self._headers = []
        self._hosts = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        elif name in _ODD:
            self._odd = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done = True
        if not self._ended:
            # Asked here: llhttp clears the flags it reads from at the message's end.
            self._keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self._ended:
            if not self._body:
                self._body = body
            else:
                if type(self._body) is bytes:
                    self._body = bytearray(self._body)
                self._body += body  # in place: a body in many reads is not copied whole each time

    def on_message_complete(self) -> None:
        self._ended = True

    # -- the fast path's client (``proxy/protocol.py``'s ``Client``) ------------

    # The fast path may relay a stream to this client (``chunked`` responses, ``write_paused``).
    streams = True

    def writer(self) -> LeanProtocol:
        return self

    def start(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool = False) -> None:
        """The response head, held for the body's first write; ``chunked``: a stream, its body
        written as it comes, framed chunked (else the whole body is one write)."""
        content = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            content += (name, b": ", value, b"\r\n")
        check_header_bytes(content)
        if not self._keep_alive:
            content.append(b"connection: close\r\n")
        if chunked:
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._head = b"".join(content)
        self._chunked = chunked

    @property
    def write_paused(self) -> bool:
        """Whether the client's buffer is above its high-water mark (a stream waits for ``writable``)."""
        return self._write_paused

    def flush(self) -> None:
        """Send a held head on its own (a stream whose first bytes are not there yet)."""
        head, self._head = self._head, None
        if head is None:
            return
        if self.transport.is_closing():
            raise ClientGone("the client's connection closed before the response began", nothing_sent=True)
        self.transport.write(head)

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None:
        """Body bytes after the held head, in one write; the request is over after the last
        (not ``more``). Only a stream (``chunked``) has more than one."""
        head, self._head = self._head, None
        transport = self.transport
        if transport.is_closing():
            if not more:
                self._busy = False
            raise ClientGone("the client's connection closed", nothing_sent=head is not None)
        if self._chunked:
            if body:
                transport.write((CHUNK if more else LAST_CHUNK) % (head or b"", len(body), body))
            elif more:
                if head is not None:
                    transport.write(head)
            else:
                transport.write(head + b"0\r\n\r\n" if head is not None else b"0\r\n\r\n")
            if more:
                return None
            self._chunked = False
        else:
            assert not more, "a response that is not a stream is written whole"
            self._write_whole(head + body if head is not None else body)
        self._answered()
        return None

    def respond(self, status: int, lines: list[bytes], body: bytes) -> None:
        """A whole response in one write: its head from ``lines`` (name, ``": "``, value, CRLF a
        field, as ``start`` lays them out), then ``body``; the request is over.

        ``lines`` are not checked again (``check_header_bytes``): the fast path's answer is the
        upstream's fields, which its connection's parser (llhttp, strict) read, refusing every
        byte the check would, and fields the gateway writes (tests/proxy/test_headers.py)."""
        if self.transport.is_closing():
            self._busy = False
            raise ClientGone("the client's connection closed", nothing_sent=True)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        content += lines
        if not self._keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        self._head = None
        self._write_whole(b"".join(content))
        self._answered()

    def _write_whole(self, data: bytes) -> None:
        due = self._due
        if not due:
            # The pass's first write: made now, the pass's end marked for any after it.
            due.append(outbox.WRITTEN)
            self.loop.call_soon(self._flush_due)
            self.transport.write(data)
        elif self._out is None:
            self._out = data
            due.append(self)
        else:
            self._out += data  # an answer this pass already left: this one goes after it

    def send_out(self) -> None:
        """Write the answer ``write`` left in the outbox (unless sent or dropped since), and
        watch what the client leaves of it."""
        self._write_out()
        if self._unsent is not None:
            self._unsent.arm()

    def _write_out(self) -> None:
        data, self._out = self._out, None
        if data is not None and not self.transport.is_closing():
            self.transport.write(data)

    def ended(self) -> None:
        """The exchange is no longer the fast path's (answered, or handed over)."""
        self.lost = self.writable = _nothing

    def close(self) -> None:
        self._busy = False
        self._write_out()
        self.transport.close()
        if self._unsent is not None:
            self._unsent.arm()  # the close waits for what the client has not taken

    def abort(self) -> None:
        """Drop the client's connection at once: a stalled stream's (a close would wait for it to
        take the bytes it does not take)."""
        self._busy = False
        self._out = None
        self.transport.abort()

    def watch(self) -> None:
        """Read the client's connection again (a request behind this one paused it): its close is seen."""
        if self._paused and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def run(self, app: App) -> None:
        """Run ``app`` for the request in a task (the hand-over): on the full protocol, which
        is given the connection and the request's bytes, its body taken as ``receive`` takes it."""
        self._busy = False
        data, self._data = self._data, b""

        def offer(scope: Any, body: bytes | bytearray, client: Any) -> bool:
            client.run(app)
            return True

        full = self._switch(data, offer)
        full._fast_client = None

    # -- the rest ------------------------------------------------------------

    def _serving(self) -> bool:
        return self._busy

    def _answered(self) -> None:
        """The response is written: the next request, or the keep-alive wait, or the close."""
        self._busy = False
        self._data = b""
        self.server_state.total_requests += 1
        if self._out is not None:
            if not self._keep_alive:
                self.send_out()  # before the close (else watched once the pass's writes are out)
            elif self._unsent is not None:
                # An earlier answer's check, due before the flush (uvloop runs due timers first):
                # the watch starts again once this answer is out (``send_out``).
                self._unsent.cancel()
        elif self._unsent is not None:
            self._unsent.arm()  # what the client has not taken of it
        if not self._keep_alive:
            self.transport.close()
            return
        if self._pending:
            # After this callback: the exchange gives back its connection and records first.
            self.loop.call_soon(self._next)
            return
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self._keep_alive_s, self._idle)

    def _next(self) -> None:
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        if self._busy or not self._pending or self._full is not None or self.transport.is_closing():
            return  # served already, with what came after them (``data_received``)
        data, self._pending = self._pending, b""
        self.data_received(data)

    def _idle(self) -> None:
        """The keep-alive wait's timer: close a connection idle for ``timeout_keep_alive``."""
        self._idle_timer = None
        if self._busy or self._full is not None or not self._idle_since:
            return  # in use: armed again after its next response
        left = self._idle_since + self._keep_alive_s - self.loop.time()
        if left > 0:
            self._idle_timer = self.loop.call_later(left, self._idle)
        elif not self.transport.is_closing():
            self._write_out()
            self.transport.close()

    def _silent(self) -> None:
        """No request head within ``header_timeout_s`` of the connection's start: the full
        protocol's 408."""
        self._head_timer = None
        full = self._switch(b"")
        full._cancel_head_timer()
        full._head_too_slow()

    def _body_too_slow(self) -> None:
        """The body did not come within ``body_timeout_s`` of its head: the full protocol's 408."""
        self._body_timer = None
        full = self._switch(self._raw)
        full._cancel_body_timer()
        full._body_too_slow()

    def _hold_body(self) -> bool:
        """Charge the budget for the body's bytes held so far; False where they do not fit."""
        budget = self._budget
        if budget is None:
            return True
        held = len(self._body)
        if held > self._charged:
            if not budget.take(held - self._charged):
                return False
            self._charged = held
        return True

    def _give_back(self) -> None:
        if self._charged:
            assert self._budget is not None
            self._budget.give_back(self._charged)
            self._charged = 0

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_body_timer()
        if self._unsent is not None:
            self._unsent.cancel()  # the full protocol watches its own responses
            self._unsent = None  # it refers to this protocol: freed without the collector
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _switch(
        self, data: bytes | bytearray, offer: Callable[[Any, bytes | bytearray, Any], bool] | None = None
    ) -> GatewayProtocol:
        """Give the connection to the full protocol, with ``data`` (the bytes of the request being
        read, from its first) and any read after it; ``offer`` stands for the app's fast path for
        the first request (None: it is not offered)."""
        self._write_out()  # an answer left for the pass's end goes before anything the full one writes
        # A body still coming is due when it was due here, not a new wait from now.
        body_due = self._body_timer.when() if self._body_timer is not None else 0.0
        self._cancel_timers()
        self._give_back()  # the full protocol's request charges what it holds
        self.server_state.connections.discard(self)
        full = self.full(
            config=self.config, server_state=self.server_state, app_state=self.app_state, _loop=self.loop
        )
        self._full = full
        transport = self.transport
        transport.set_protocol(full)
        full.connection_made(transport)
        if self._first_deadline:
            # The connection's first head: due when it was due here, not a new wait from now.
            full._cancel_head_timer()
            full._head_timer = self.loop.call_at(self._first_deadline, full._head_too_slow)
        if self._write_paused:
            full.pause_writing()
        if full._unsent is not None:
            full._unsent.arm()  # what is left of this protocol's answers, watched by the full one
        if self.client is not None:
            # As read at the connection's start (a closed transport no longer says).
            full.client, full.server, full.scheme = self.client, self.server, self.scheme  # type: ignore[assignment]
        data += self._pending
        self._pending = b""
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if data:
            full.replay(bytes(data), offer)
        if body_due and full._body_timer is not None:
            full._cancel_body_timer()
            full._body_timer = self.loop.call_at(body_due, full._body_too_slow)
        if self._shut_down:
            full.shutdown()  # its response says ``connection: close``, and the connection closes after it
        return full


def server_protocol(
    header_timeout_s: float, max_header_bytes: int, body_timeout_s: float = 60.0
) -> type[LeanProtocol]:
    """The server's protocol with these limits, as uvicorn's ``http`` setting takes a class:
    the lean one, with the full one (``proxy.protocol.protocol_class``) behind it."""
    full = protocol_class(header_timeout_s, max_header_bytes, body_timeout_s)
    return type(
        "LeanProtocol",
        (LeanProtocol,),
        {
            "full": full,
            "header_timeout_s": header_timeout_s,
            "max_header_bytes": max_header_bytes,
            "body_timeout_s": body_timeout_s,
        },
    )
