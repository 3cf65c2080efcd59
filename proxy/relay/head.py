"""A request's header fields as the relay's fast path reads them: one walk, not one a check.

On the task path each reader walks the fields itself: the browser checks
(``proxy/browser.py``), the head's checks (``proxy/relay/request.py``'s
``check_head``), the request id (``proxy/relay/ids.py``) and the upstream's
head (``proxy/relay/exchange.py``). The fast path (``proxy/relay/fast.py``)
reads them all from one walk, ``HeadFields``, and decides with the same
rules: each is a function of the values noted here, shared with its
walk (``BrowserChecks.refusal_of``, ``refuses_head``, ``RequestIds.of``).
A head the walk cannot speak for (two Host fields, a Connection field
naming others, two Connection fields) is read by the task path's walks
instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from mypy_extensions import mypyc_attr

from proxy.headers import Header, valid_request_id
from proxy.relay.request import unsupported_media

_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close"})


# Made for each request and holding bytes and numbers only: a freed one is kept for the next
# (compiled), and the collector never visits one.
@mypyc_attr(acyclic=True, free_list_len=1)
class HeadFields:
    """One walk of a request's fields: what the checks read, and the fields that cross upstream
    (``forward``: the head's lines, or None where a Connection field names fields to drop)."""

    __slots__ = (
        "declared",
        "forward",
        "host",
        "hosts",
        "largest",
        "media",
        "origin",
        "origins",
        "request_id",
        "site",
        "unsupported",
    )

    def __init__(self, headers: Iterable[Header], drop: frozenset[bytes]) -> None:
        host = origin = site = request_id = None
        hosts = origins = 0
        media = b""
        unsupported = connection = False
        declared = largest = -1
        forward: list[bytes] | None = []
        for name, value in headers:
            if name in drop:
                if name == b"host":
                    hosts += 1
                    if host is None:
                        host = value
                elif name == b"content-type":
                    media = value.split(b";", 1)[0].strip().lower()
                    if unsupported_media(media):
                        unsupported = True
                elif name == b"content-length":
                    if value.isdigit():
                        declared = int(value)
                        if declared > largest:
                            largest = declared
                elif name == b"x-request-id":
                    if request_id is None and valid_request_id(value):
                        request_id = bytes(value)
                elif name == b"connection":
                    # One naming nothing but itself; else the task path's rule (it may drop fields).
                    if connection or value.lower() not in _PLAIN_CONNECTION:
                        forward = None
                    connection = True
                continue
            if name == b"origin":
                origins += 1
                origin = value
            elif name == b"sec-fetch-site":
                site = value
            if forward is not None:
                forward += (name, b": ", value, b"\r\n")
        self.host = host
        self.hosts = hosts
        self.origin = origin
        self.origins = origins
        self.site = site
        self.media = media
        self.unsupported = unsupported
        self.declared = declared
        self.largest = largest
        self.request_id = request_id
        self.forward = forward
