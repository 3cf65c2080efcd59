"""Upstream codings: a transfer coding the gateway cannot read is a 502; a content coding goes on intact."""

from __future__ import annotations

import socket
import zlib

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def until_close(gateway: Running, fault: str, stream: bool = True) -> tuple[bytes, bytes]:
    """A request with ``x-fake: fault`` and ``Connection: close`` on a raw socket: the head, the raw body."""
    body = orjson.dumps({**BODY, "stream": stream})
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=20) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"x-fake: %s\r\nContent-Length: %d\r\n\r\n" % (CHAT.encode(), fault.encode(), len(body)) + body
        )
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.lower(), rest


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked message, and whether it ended with its last chunk (False: cut short)."""
    body = b""
    while raw:
        size_line, sep, raw = raw.partition(b"\r\n")
        if not sep:
            return body, False
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body, raw.startswith(b"\r\n")
        if len(raw) < size + 2:
            return body + raw[:size], False
        body, raw = body + raw[:size], raw[size + 2 :]
    return body, False


def gunzip(data: bytes) -> tuple[bytes, bool]:
    """The decoded bytes, and whether the gzip member was whole (its trailer checked)."""
    decoder = zlib.decompressobj(wbits=31)
    return decoder.decompress(data), decoder.eof


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
def test_an_upstream_transfer_coding_other_than_chunked_is_a_502(gateway: Running, fake: FakeEngine) -> None:
    """``Transfer-Encoding: gzip, chunked`` upstream: 502 upstream_bad_response, not raw gzip as JSON."""
    with httpx.Client(trust_env=False, timeout=20) as http:
        reply = http.post(gateway.url + CHAT, json=BODY, headers={"x-fake": "head=te-gzip"})
        assert reply.status_code == 502, reply.content[:200]
        error = reply.json()["error"]
        assert error["code"] == "upstream_bad_response" and "gzip, chunked" in error["message"], error
        assert http.post(gateway.url + CHAT, json=BODY).status_code == 200


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
def test_a_gzipped_event_stream_is_relayed_intact(gateway: Running, fake: FakeEngine) -> None:
    """A close-delimited SSE stream under Content-Encoding: gzip reaches the client whole, with its header."""
    head, raw = until_close(gateway, "gzip")
    assert head.startswith(b"http/1.1 200") and b"content-encoding: gzip" in head, head
    body, whole = dechunk(raw)
    assert whole, raw[-100:]
    events, complete = gunzip(body)
    assert complete, body[-50:]
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n"), events[-200:]


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_a_gzipped_event_stream_cut_short_is_cut_for_the_client_too(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """Chunked upstream, gzip stream cut after 2 events: the client's response is cut (no last chunk),
    with no plain-text error event inside the coded bytes."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url})
    head, raw = until_close(gateway, "gzip; die-after=2")
    assert b"content-encoding: gzip" in head, head
    body, whole = dechunk(raw)
    assert not whole
    events, complete = gunzip(body)
    assert not complete and events.count(b"data: {") == 2 and b'"error"' not in events, events


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_a_close_delimited_gzipped_stream_cut_short_is_seen_by_the_clients_decoder(
    gateway: Running, fake: FakeEngine
) -> None:
    """HTTP/1.0 upstream: the close ends the body, so the gateway cannot tell; the gzip member
    it relays intact has no trailer, which the client's decoder sees."""
    _, raw = until_close(gateway, "gzip; die-after=2")
    body, _ = dechunk(raw)
    events, complete = gunzip(body)
    assert not complete and events.count(b"data: {") == 2 and b"[DONE]" not in events, events


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
def test_a_gzipped_stream_after_the_gateways_heartbeats_ends_with_a_readable_error_event(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """Once the gateway's own uncoded head is out, a coded stream cannot follow it: one plain error event."""
    gateway = start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2")
    head, raw = until_close(gateway, "gzip; prefill=0.7")
    assert b"content-encoding" not in head, head
    body, whole = dechunk(raw)
    assert whole and body.startswith(b": keepalive\n\n"), body[:200]
    last = [e for e in body.split(b"\n\n") if e.strip()][-1]
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_bad_response" and "coded" in error["message"], error
