"""The fast upstream of the matrix's non-stream (json) cells: as lean as an HTTP/1.1 server gets in Python.

uvloop and httptools' request parser, nothing else: every POST, whatever
its path and body, is answered at once with the same ~1 KB chat completion,
head and body in one ``transport.write``, HTTP/1.1 keep-alive with a
Content-Length. ``GET /health`` and ``GET /v1/models`` are answered too (a
gateway or a person may probe); any other GET gets a 404. Direct p50 at C=1
is ~20 µs on one core of the benchmark VM, against ~107 µs for the fake
engine (``tests/fake_engine.py``, which parses the request and builds each
reply): a gateway's or nginx's added time is then a share of a small whole,
not of the engine's own cost.

    python -m perf.fast_upstream [--port 0] [--host 127.0.0.1]

prints ``PORT <n>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys

import httptools
import orjson


def _completion() -> bytes:
    """A chat completion of ~1 KB, as an OpenAI-compatible engine sends it."""
    content = (
        "A gateway sits between the clients and the engines: it routes each request by its model, "
        "keeps connections to the engines open, relays the answer as it comes and logs what it did. "
        "Its own cost should be small beside the engine's, which is what this benchmark measures. "
        "This reply is always the same, so that every surface relays exactly the same bytes, and it "
        "is long enough to look like a real answer of a hundred tokens or so, without being long "
        "enough for its copying to matter. The engine that sends it does nothing else at all: no "
        "tokenizer, no model, no scheduler, only a parser and one write per request."
    )
    body = {
        "id": "chatcmpl-fast-upstream-0000000000000000",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m1",
        "system_fingerprint": "fp_fast_upstream",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 180, "completion_tokens": 96, "total_tokens": 276},
    }
    return orjson.dumps(body)


BODY = _completion()


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        b"Connection: keep-alive\r\n"
        b"\r\n" + body
    )


COMPLETION = _response(b"200 OK", BODY)
HEALTH = _response(b"200 OK", b'{"status":"ok"}')
MODELS = _response(
    b"200 OK",
    orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "fast-upstream"}
                for name in ("m1", "m2")
            ],
        }
    ),
)
NOT_FOUND = _response(b"404 Not Found", b'{"error":"not found"}')


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, answer each when its body has arrived."""

    __slots__ = ("parser", "transport", "url")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.parser.get_method() == b"POST":
            self.transport.write(COMPLETION)
        else:
            path = self.url.split(b"?", 1)[0]
            self.transport.write(
                HEALTH if path == b"/health" else MODELS if path == b"/v1/models" else NOT_FOUND
            )
        self.url = b""
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"PORT {bound}\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.fast_upstream", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
