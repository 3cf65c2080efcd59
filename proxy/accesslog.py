"""The access log: one line per relayed request, as text or JSON.

A line begins with the client and the time it was written, in UTC to the
millisecond (text: ``127.0.0.1 [2026-12-01T20:15:03.123Z] "POST /v1/…" …``;
JSON: ``"time"`` first).

Written after the response has ended, never per chunk. Probes and /metrics
are not logged. The client address is the peer's, or, when the peer is one
of the configured proxies (--forwarded-allow-ips), the nearest untrusted
address in its X-Forwarded-For; keys and bodies are never logged.

A line costs a tuple of its fields and a list append on the request's
path. The lines wait in a buffer that is formatted and written in one go,
off the request's path:
by a timer on the event loop ``FLUSH_AFTER_S`` after the first line of a
batch, at once when ``MAX_LINES`` are waiting, and at exit (so SIGTERM, a
drain or an exception that ends the process loses none; SIGKILL loses what
waits). Going through ``logging`` for each line, with a ``write`` and a flush
each time, cost 22-37 µs of CPU a line here, this ~4 µs; see
``python -m perf accesslog``.

A request for a model no route serves (a 404 model_not_found) carries the
name the client asked for, cut to ``MODEL_LIMIT_CHARS`` (with a ``…``): in
a text line with spaces, quotes, backslashes and control or other
unprintable characters written as ``\\xHH`` (``\\uHHHH``), as nginx escapes
its variables, so that the line still splits on spaces; in JSON as given.
Known names come from the configuration and go out as they are.

A request to a model of several servers that moved (its first server
refused the connection, so it went to another) carries every server tried,
in order, as nginx's ``$upstream_addr`` does: ``upstream=A,B`` at the end of
a text line, ``"upstream": ["A", "B"]`` in JSON. A request that did not move
has neither, and pays one ``is None`` test for it.

Where the lines go is still the "blazar.access" logger's configuration,
read at each flush: a handler that writes the bare message to a stream (the
CLI's, on stderr) gets the whole batch in one write; any other handler gets
one record per line, as before.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Final

import orjson
from mypy_extensions import mypyc_attr

from proxy.asgi import Scope
from proxy.errors import ECHO_LIMIT
from proxy.forwarded import ProxyTrust
from proxy.timers import LoopTimer

log: Final = logging.getLogger("blazar.access")

# A line waits at most this long (plus the loop's own lag) before it is written.
FLUSH_AFTER_S: Final = 0.05
# And at most this many lines wait: the buffer is bounded, and so is one write.
# A batch is formatted as it is written: a pause for the requests behind it. A batch
# of 512 (all of 50 ms at ~6,000 requests a second) made it ~0.75 ms and doubled the
# added p99 at C=1; 32 lines take ~0.1 ms.
MAX_LINES: Final = 32

_INFO: Final = logging.INFO

# The running loop or None: asyncio's own accessor, which does not raise. It
# costs a getpid() system call (its fork check), so it is called once a batch.
_running_loop = asyncio._get_running_loop

# The most of a client's unknown model name a line carries (proxy.errors.echo's bound).
MODEL_LIMIT_CHARS: Final = ECHO_LIMIT

# The text line; %-formatting gives the same bytes as the f-string it replaced, faster.
_TEXT: Final = '%s [%s] "%s %s" %s %s %.3fms ttfb=%sms overhead=%sms model=%s id=%s'
# The same, for a line with both of its times (most): one formatting, not three.
_TEXT_TIMED: Final = '%s [%s] "%s %s" %s %s %.3fms ttfb=%.3fms overhead=%.3fms model=%s id=%s'


# A line's fields as ``write`` keeps them: the clock's reading, the client, the method, the path,
# the request's id, model, status, bytes, duration, time to the upstream's head, the gateway's own
# time, and the servers it moved between (or None).
_Fields = tuple[
    int, str, str, str, bytes, str, int, int, float, "float | None", "float | None", "list[str] | None"
]


class Clock:
    """The time a line is written, in UTC: ISO 8601 to the millisecond (``2026-12-01T20:15:03.123Z``).

    The date and the second are formatted once a second, as nginx caches
    its ``$time_local``; a line pays one ``time_ns()`` when written, and two
    divisions and a look-up of its milliseconds when formatted.
    """

    __slots__ = ("_second", "_text", "now_ns")

    def __init__(self, now_ns: Callable[[], int] = time.time_ns) -> None:
        # The reading: ``write`` takes it on the request's path, ``format`` turns it into text later.
        self.now_ns = now_ns
        self._second = -1
        self._text = ""

    def __call__(self) -> str:
        return self.format(self.now_ns())

    def format(self, now_ns: int) -> str:
        """A reading of this clock as a line's time."""
        ms = now_ns // 1_000_000
        second = ms // 1000
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return self._text + _MILLIS[ms % 1000]


# ".000Z" to ".999Z": a line's milliseconds, formatted once.
_MILLIS: Final = tuple(f".{ms:03d}Z" for ms in range(1000))


class AccessLog:
    def __init__(
        self, fmt: str = "text", trusted_proxies: Iterable[str] = (), clock: Clock | None = None
    ) -> None:
        if fmt not in ("text", "json"):
            raise ValueError(f"log format {fmt!r}: text or json")
        self.json = fmt == "json"
        self.clock = clock or Clock()
        self.client = ProxyTrust(trusted_proxies).client
        # The waiting lines, as their fields (formatted by ``flush``).
        self._lines: list[_Fields] = []
        # The clock's own reading (``time.time_ns``): a C call on the request's path.
        self._now_ns = self.clock.now_ns
        # Whether the loop whose timer will write the waiting lines still runs (its ``is_running``,
        # set by ``_schedule``, which writes them at once where no loop runs), and that timer.
        self._loop_runs: Callable[[], bool] = _no_loop
        self._timer: LoopTimer | None = None
        # Formatted by each handler at each flush: one that gives back the bare
        # message gets the batch in one write (made once: a record costs ~5 µs).
        self._probe = logging.LogRecord(log.name, logging.INFO, __file__, 0, "\x00", (), None)
        # Written at exit if it is still alive then (a weak reference: a log no longer used is
        # not kept for it), through a holder that a weak reference can reach (compiled, this
        # class cannot be weakly referenced).
        self._at_exit = _AtExit(self)
        atexit.register(_flush_at_exit, weakref.ref(self._at_exit))

    def write(
        self,
        scope: Scope,
        *,
        request_id: bytes,
        model: str,
        status: int,
        bytes_out: int,
        duration_s: float,
        ttfb_s: float | None,
        overhead_s: float | None,
        upstreams: list[str] | None = None,
    ) -> None:
        """One request's line; ``upstreams``: the servers it was sent to, in order, if it moved.

        Only its fields are kept here (and the clock read): the line is formatted with the
        rest of its batch, when the batch is written (``flush``).
        """
        self.add(scope, request_id, model, status, bytes_out, duration_s, ttfb_s, overhead_s, upstreams)

    def add(
        self,
        scope: Scope,
        request_id: bytes,
        model: str,
        status: int,
        bytes_out: int,
        duration_s: float,
        ttfb_s: float | None,
        overhead_s: float | None,
        upstreams: list[str] | None,
    ) -> None:
        """``write`` with its fields in order, as the relay gives them (a call without keywords)."""
        if not log.isEnabledFor(_INFO):
            return
        lines = self._lines
        # Strings and numbers only: no container of the request's (its scope, its headers)
        # outlives the request in the buffer, for the collector to visit.
        lines.append(
            (
                self._now_ns(),
                self.client(scope),
                scope["method"],
                scope["path"],
                request_id,
                model,
                status,
                bytes_out,
                duration_s,
                ttfb_s,
                overhead_s,
                upstreams,
            )
        )
        waiting = len(lines)
        if waiting == 1:
            self._schedule()
        elif waiting >= MAX_LINES or not self._loop_runs():
            # Full; or the loop whose timer would write these has stopped (a test's).
            self.flush()

    def _format(self, batch: list[_Fields]) -> list[str]:
        """A batch's lines, as text: one loop, no call a line but the clock's."""
        if self.json:
            return list(map(self._json, batch))
        time_of = self.clock.format
        out: list[str] = []
        append = out.append
        for (
            now_ns,
            client,
            method,
            path,
            request_id,
            model,
            status,
            bytes_out,
            duration_s,
            ttfb_s,
            overhead_s,
            upstreams,
        ) in batch:
            if ttfb_s is not None and overhead_s is not None:
                line = _TEXT_TIMED % (
                    client,
                    time_of(now_ns),
                    method,
                    path,
                    status,
                    bytes_out,
                    duration_s * 1000,
                    ttfb_s * 1000,
                    overhead_s * 1000,
                    model or "-",
                    request_id.decode("latin-1"),
                )
            else:
                line = _TEXT % (
                    client,
                    time_of(now_ns),
                    method,
                    path,
                    status,
                    bytes_out,
                    duration_s * 1000,
                    "%.3f" % (ttfb_s * 1000) if ttfb_s is not None else "-",
                    "%.3f" % (overhead_s * 1000) if overhead_s is not None else "-",
                    model or "-",
                    request_id.decode("latin-1"),
                )
            if upstreams is not None:
                line += " upstream=" + ",".join(upstreams)
            append(line)
        return out

    def _json(self, fields: _Fields) -> str:
        """One line, in JSON."""
        (
            now_ns,
            client,
            method,
            path,
            request_id,
            model,
            status,
            bytes_out,
            duration_s,
            ttfb_s,
            overhead_s,
            upstreams,
        ) = fields
        record = {
            "time": self.clock.format(now_ns),
            "client": client,
            "method": method,
            "path": path,
            "request_id": request_id.decode("latin-1"),
            "model": model,
            "status": status,
            "bytes": bytes_out,
            "duration_ms": round(duration_s * 1000, 3),
            "ttfb_ms": round(ttfb_s * 1000, 3) if ttfb_s is not None else None,
            "overhead_ms": round(overhead_s * 1000, 3) if overhead_s is not None else None,
        }
        if upstreams is not None:
            record["upstream"] = upstreams
        return orjson.dumps(record).decode()

    def asked_model(self, name: str) -> str:
        """A model name the client gave that no route serves, as this log's lines can carry it."""
        cut = cut_model(name)
        return cut if self.json else "".join(map(_text_safe, cut))

    def _schedule(self) -> None:
        """Arm the timer that writes the batch this line begins: once per batch, not per line."""
        loop = _running_loop()
        if loop is None:
            self._loop_runs = _no_loop
            self.flush()  # no loop to write later from: write now
        else:
            self._loop_runs = loop.is_running
            self._timer = loop.call_later(FLUSH_AFTER_S, self.flush)

    def flush(self) -> None:
        """Write every waiting line now, in one write per handler."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._lines = self._lines, []
        if waiting:
            _emit(self._format(waiting), self._probe)

    def pending(self) -> int:
        """How many lines wait to be written."""
        return len(self._lines)


def cut_model(name: str) -> str:
    """A client's model name, cut to ``MODEL_LIMIT_CHARS`` (with a ``…``)."""
    return name[:MODEL_LIMIT_CHARS] + ("…" if len(name) > MODEL_LIMIT_CHARS else "")


def _text_safe(char: str) -> str:
    """One character of client text in a text line: as it is, or escaped if it could break the line."""
    if char.isprintable() and not char.isspace() and char not in '"\\':
        return char
    code = ord(char)
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}"


def _no_loop() -> bool:
    """No loop runs to write the waiting lines later."""
    return False


@mypyc_attr(native_class=False)
class _AtExit:
    """An access log, held for the flush at exit: a Python object, which a weak reference can reach.
    The log holds it, and it the log: the two go together, with the collector's next pass."""

    def __init__(self, access: AccessLog) -> None:
        self.access = access


def _flush_at_exit(ref: weakref.ReferenceType[_AtExit]) -> None:
    held = ref()
    if held is not None:
        held.access.flush()


def _handlers() -> list[logging.Handler]:
    """The handlers "blazar.access" records reach, as ``Logger.callHandlers`` walks them."""
    found: list[logging.Handler] = []
    logger: logging.Logger | None = log
    while logger is not None:
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found


def _emit(lines: list[str], probe: logging.LogRecord) -> None:
    for handler in _handlers():
        if handler.level <= logging.INFO and not _write_batch(handler, lines, probe):
            for line in lines:
                handler.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None))


def _write_batch(handler: logging.Handler, lines: list[str], probe: logging.LogRecord) -> bool:
    """Whether ``handler`` took the batch in one write (a stream handler that writes the bare
    message; or it failed, and said so): False leaves it a record per line."""
    if not isinstance(handler, logging.StreamHandler) or handler.stream is None or handler.filters:
        return False
    handler.acquire()
    try:
        if handler.format(probe) != "\x00":
            return False
        # Writes the bare message: the whole batch in one write, as the handler would have.
        handler.stream.write(handler.terminator.join(lines) + handler.terminator)
        handler.flush()
    except Exception:
        # As logging's own emit does: a log that cannot be written must not
        # fail the request whose line filled the batch.
        handler.handleError(probe)
    finally:
        handler.release()
    return True
