"""The client's request as the relay takes it: a POST, a JSON body, read once and bounded.

Bounded twice: each body by ``--max-body-bytes`` (413), and all bodies held
at once by a budget, ``--body-budget-bytes`` (503 with Retry-After: the
gateway's memory, not the request, is the limit). A body is charged to the
budget as its bytes arrive (when they take memory), and given back when it
is no longer held: once its upstream has answered (it has read the body), or
when the request ends, whichever comes first. A head that declares a length
the budget has no room left for is refused at once, but a declared length
reserves nothing: a head alone holds none of the budget.

A body costs about its own size: its pieces are appended to one buffer as
they come (no list of pieces joined at the end, which held the body twice),
and the relay drops its parsed document before the exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from mypy_extensions import mypyc_attr

from proxy.asgi import Message, Receive, Scope
from proxy.errors import HTTPError, echo
from proxy.upstream_errors import ClientGone

if TYPE_CHECKING:
    from proxy.relay.head import HeadFields

# curl -d sends this unless told otherwise; the body is JSON all the same.
FORM: Final = b"application/x-www-form-urlencoded"
_ACCEPTED_CONTENT_TYPES: Final = frozenset({b"application/json", FORM})


class BodyBudget:
    """The request-body bytes that all requests may hold at once, and how many they hold."""

    __slots__ = ("held_bytes", "limit_bytes")

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, size: int) -> bool:
        """Charge ``size`` bytes if they fit; whether they did."""
        if self.held_bytes + size > self.limit_bytes:
            return False
        self.held_bytes += size
        return True

    def has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes would fit now (nothing is charged)."""
        return self.held_bytes + size <= self.limit_bytes

    def give_back(self, size: int) -> None:
        self.held_bytes -= size


# Made for each request, holding its bytes and the budget (which holds numbers): a freed one is
# kept for the next (compiled), and the collector never visits one.
@mypyc_attr(acyclic=True, free_list_len=1)
class RequestBody:
    """One request's body (``data``) and its charge to the budget, given back by ``drop``."""

    __slots__ = ("_budget", "charged_bytes", "data")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.data: bytes | bytearray = b""
        self.charged_bytes = 0

    @property
    def limit_bytes(self) -> int:
        return self._budget.limit_bytes

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes would fit in the budget now (nothing is charged)."""
        return self._budget.has_room(size)

    def charge(self, size: int) -> None:
        """Charge ``size`` more bytes to the budget, or 503 when they do not fit."""
        budget = self._budget
        if not budget.take(size):
            raise over_budget(budget.limit_bytes)
        self.charged_bytes += size

    def hold(self, data: bytes | bytearray) -> None:
        """Hold ``data``, charged to the budget without a check: the caller has just seen that it
        fits (``BodyBudget.has_room``), and nothing has run since (the fast path's body, whole)."""
        self.data = data
        size = len(data)
        self._budget.held_bytes += size
        self.charged_bytes += size

    def replace(self, data: bytes) -> None:
        """The body re-serialised (an alias, a stream asked for): held instead of the client's."""
        self.data = data
        extra = len(data) - self.charged_bytes
        if extra > 0:
            # Charged without a refusal: the request is admitted already, and the old body is freed.
            self._budget.held_bytes += extra
            self.charged_bytes += extra

    def drop(self) -> None:
        """No longer held: give its bytes back to the budget (again: nothing)."""
        self.data = b""
        if self.charged_bytes:
            self._budget.held_bytes -= self.charged_bytes  # ``give_back``, written out
            self.charged_bytes = 0


async def read_request(scope: Scope, receive: Receive, limit: int, body: RequestBody) -> None:
    """Read the request's body into ``body``, once its method and content type are checked.

    405, 413, 415, 503 (the budget) or ClientGone; whatever was charged stays
    on ``body`` for the caller to ``drop``.
    """
    check_head(scope, limit, body)
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        # The common case: the whole body came with the head.
        data: bytes = message.get("body", b"")
        if len(data) > limit:
            raise too_large(limit)
        if data:
            body.charge(len(data))
        body.data = data
        return
    # Its deadline (--body-timeout, from the end of the head) is the protocol's (proxy/protocol.py).
    await _read_rest(message, receive, limit, body)


def check_head(scope: Scope, limit: int, body: RequestBody) -> None:
    """The request's method and head, before its body is read: 405, 413, 415 or 503 (the budget)."""
    if scope["method"] != "POST":
        raise HTTPError(
            405,
            f"method {echo(scope['method'])} is not allowed on {echo(scope['path'])}; use POST",
            code="method_not_allowed",
            headers=((b"allow", b"POST"),),
        )
    media = b""
    from_browser = False
    declared = -1
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit():
                declared = int(value)
                if declared > limit:
                    raise too_large(limit)
        elif name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if unsupported_media(media):
                given = echo(media.decode("latin-1"))
                raise HTTPError(
                    415,
                    f"Content-Type {given!r} is not supported; send application/json",
                    code="unsupported_media_type",
                )
        elif name == b"origin":
            from_browser = True
    if from_browser and media == FORM:
        # A form type needs no CORS preflight: any web page could make a
        # visitor's browser run generations here. Browsers must send JSON.
        raise HTTPError(
            415,
            "a browser request must send Content-Type: application/json",
            code="unsupported_media_type",
        )
    if declared > 0 and not body.fits(declared):
        # It could not be held whole now: refused before any of it is read. Nothing is
        # reserved: a head alone must not hold the budget (its bytes are charged as they come).
        raise over_budget(body.limit_bytes)


def unsupported_media(media: bytes) -> bool:
    """Whether a body of this media type (lower-cased, no parameters) is refused (415)."""
    return media not in _ACCEPTED_CONTENT_TYPES and not media.endswith(b"+json")


def refuses_head(fields: HeadFields, limit: int, budget: BodyBudget) -> bool:
    """Whether ``check_head`` refuses a POST with these fields, read from ``HeadFields``' walk."""
    return (
        fields.largest > limit
        or fields.unsupported
        or (fields.origins > 0 and fields.media == FORM)
        or (fields.declared > 0 and not budget.has_room(fields.declared))
    )


async def _read_rest(message: Message, receive: Receive, limit: int, body: RequestBody) -> None:
    # One buffer, grown in place (realloc): the body is held once, not as pieces and then joined.
    buffer = bytearray()
    while True:
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk: bytes = message.get("body", b"")
        if len(buffer) + len(chunk) > limit:
            raise too_large(limit)
        if chunk:
            body.charge(len(chunk))
        buffer += chunk
        if not message.get("more_body", False):
            body.data = buffer
            return
        message = await receive()


def over_budget(limit_bytes: int) -> HTTPError:
    return HTTPError(
        503,
        f"the gateway holds as many request-body bytes as it may at once ({limit_bytes} bytes, its "
        "--body-budget-bytes); retry shortly",
        code="body_budget_exhausted",
        headers=((b"retry-after", b"1"),),
    )


def too_large(limit: int) -> HTTPError:
    return HTTPError(
        413,
        f"request body is larger than the limit of {limit} bytes "
        "(the gateway's --max-body-bytes, or its --body-budget-bytes if smaller)",
        code="request_too_large",
        headers=((b"connection", b"close"),),
    )
