"""The client's request as the relay takes it: a POST, a JSON body, read once and bounded."""

from __future__ import annotations

from proxy.asgi import Message, Receive, Scope
from proxy.errors import HTTPError, echo
from proxy.upstream import ClientGone

_ACCEPTED_CONTENT_TYPES = frozenset(
    {
        b"application/json",
        # curl -d sends this unless told otherwise; the body is JSON all the same.
        b"application/x-www-form-urlencoded",
    }
)


async def read_request(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request's body, once its method and content type are checked; 405, 413, 415 or ClientGone."""
    if scope["method"] != "POST":
        raise HTTPError(
            405,
            f"method {echo(scope['method'])} is not allowed on {echo(scope['path'])}; use POST",
            code="method_not_allowed",
            headers=((b"allow", b"POST"),),
        )
    media = b""
    from_browser = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise too_large(limit)
        elif name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if media not in _ACCEPTED_CONTENT_TYPES and not media.endswith(b"+json"):
                given = echo(media.decode("latin-1"))
                raise HTTPError(
                    415,
                    f"Content-Type {given!r} is not supported; send application/json",
                    code="unsupported_media_type",
                )
        elif name == b"origin":
            from_browser = True
    if from_browser and media == b"application/x-www-form-urlencoded":
        # A form type needs no CORS preflight: any web page could make a
        # visitor's browser run generations here. Browsers must send JSON.
        raise HTTPError(
            415,
            "a browser request must send Content-Type: application/json",
            code="unsupported_media_type",
        )
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        # The common case: the whole body came with the head.
        body: bytes = message.get("body", b"")
        if len(body) > limit:
            raise too_large(limit)
        return body
    # Its deadline (--body-timeout, from the end of the head) is the protocol's (proxy/protocol.py).
    return await _read_rest(message, receive, limit)


async def _read_rest(message: Message, receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()


def too_large(limit: int) -> HTTPError:
    return HTTPError(
        413,
        f"request body is larger than the limit of {limit} bytes (the gateway's --max-body-bytes)",
        code="request_too_large",
        headers=((b"connection", b"close"),),
    )
