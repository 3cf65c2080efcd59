"""What the relay's upstream transport raises (``proxy/upstream.py``): each error's status and code
say how the client is told.

A module of their own, not compiled with the transport: a compiled build (mypyc) fixes a class's
attributes, and tells a compiled class's instances by a test that misses a Python subclass.
"""

from __future__ import annotations

from time import perf_counter

from proxy.errors import HTTPError


class UpstreamError(HTTPError):
    """The upstream failed; the class's ``status`` and ``code`` say how the client is told."""

    status = 502
    code = "upstream_error"

    def __init__(self, message: str = "") -> None:
        cls = type(self)
        super().__init__(cls.status, message, code=cls.code)


class ConnectFailed(UpstreamError):
    status = 503
    code = "upstream_unavailable"


class EngineExited(UpstreamError):
    """An engine child exited as the request reached it (an empty reply from a process that has
    exited): killed or stopped as it came (the request unread), or crashed on it. Unavailable,
    as a refused connect is; its own code, so that a request that kills its engine shows."""

    status = 503
    code = "engine_exited"


class Overloaded(UpstreamError):
    """The gateway itself ran out of file descriptors: its own overload, not the upstream's fault."""

    status = 503
    code = "overloaded"


class HeadTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class EmptyReply(UpstreamError):
    code = "upstream_empty_reply"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        # When the close was seen (``perf_counter``): a relay that reads it later (a task, after a
        # hand-over) still knows how soon after its send the upstream closed.
        self.at = perf_counter()


class BadResponse(UpstreamError):
    code = "upstream_bad_response"


class BodyBroken(UpstreamError):
    code = "upstream_truncated"


class ReadTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class TotalTimeout(UpstreamError):
    status = 504
    code = "total_timeout"


class Draining(UpstreamError):
    """The gateway is shutting down and its drain time is over."""

    status = 503
    code = "draining"


class Cancelled(UpstreamError):
    """An operator ended the request (the status page, or ``POST /admin/requests/ID/cancel``):
    no fault of the upstream's."""

    status = 503
    code = "request_cancelled"


class ClientGone(Exception):
    """The client went away; the upstream connection was closed for it.

    ``nothing_sent``: raised by a writer that had handed the client no byte
    of the response (not even its head), so the client got nothing.
    """

    def __init__(self, message: str = "the client has gone", *, nothing_sent: bool = False) -> None:
        super().__init__(message)
        self.nothing_sent = nothing_sent
