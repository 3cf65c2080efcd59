"""Upstreams that break the rules: heads too large or ambiguous (502, memory flat), streams without [DONE]."""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway
from tests.helpers import rss_mib

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def ask(gateway: Running, fault: str) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.post(gateway.url + CHAT, json=BODY, headers={"x-fake": fault})


def assert_bad_response(reply: httpx.Response, says: str) -> None:
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] == "upstream_bad_response" and says in error["message"], error


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
def test_endless_upstream_head_is_a_502_and_memory_stays_flat(gateway: Running, fake: FakeEngine) -> None:
    """Header lines without end: 502 once the head passes 64 KiB, with the gateway's memory flat."""
    ask(gateway, "")  # warm: pools, imports
    before = rss_mib(gateway.proc.pid)
    for _ in range(3):
        assert_bad_response(ask(gateway, "head=endless"), "larger than 65536 bytes")
    grown = rss_mib(gateway.proc.pid) - before
    assert grown < 8, f"the gateway grew by {grown:.1f} MiB"
    assert ask(gateway, "").status_code == 200


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
def test_a_huge_upstream_header_line_is_not_relayed(gateway: Running, fake: FakeEngine) -> None:
    """One 70 KB header line from the upstream: 502, not relayed to the client."""
    reply = ask(gateway, "head=huge")
    assert_bad_response(reply, "larger than 65536 bytes")
    assert "x-huge" not in reply.headers


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
@pytest.mark.parametrize(
    ("fault", "says"),
    # llhttp itself refuses Content-Length beside chunked; the gateway, chunked twice.
    [("head=te-twice", "ambiguous framing"), ("head=cl-te", "Content-Length")],
)
def test_ambiguous_upstream_framing_is_a_502(
    gateway: Running, fake: FakeEngine, fault: str, says: str
) -> None:
    """Transfer-Encoding chunked twice, or with Content-Length: refused as nginx and HAProxy do."""
    assert_bad_response(ask(gateway, fault), says)
    assert ask(gateway, "").status_code == 200


def stream(gateway: Running, fault: str) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.post(gateway.url + CHAT, json={**BODY, "stream": True}, headers={"x-fake": fault})


def last_event_error(reply: httpx.Response) -> dict[str, object]:
    events = [e for e in reply.content.split(b"\n\n") if e.strip()]
    error: dict[str, object] = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    return error


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
@pytest.mark.parametrize("framing", ["", "--http11"])
def test_a_stream_that_ends_cleanly_without_done_ends_with_an_error_event(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, framing: str
) -> None:
    """Close-delimited or chunked, a stream that ends without [DONE] gets the truncation error event."""
    fake = start_fake_engine(*([framing] if framing else []))
    gateway = start_gateway({"fake": fake.url})
    reply = stream(gateway, "no-done")
    assert reply.status_code == 200
    assert b"data: [DONE]" not in reply.content
    assert last_event_error(reply)["code"] == "upstream_truncated"
    whole = stream(gateway, "")
    assert whole.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in whole.content


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
def test_a_stream_request_answered_without_an_event_stream_is_a_502(
    gateway: Running, fake: FakeEngine
) -> None:
    """A JSON body where the client asked for a stream is not a clean end of no events: 502, saying so."""
    assert_bad_response(stream(gateway, "not-sse"), "not an event stream")


@pytest.mark.fault("overload", "out of file descriptors")
def test_running_out_of_file_descriptors_is_the_gateways_own_503(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """No descriptor left for the upstream connection: 503 overloaded, Retry-After, counted as overload."""
    gateway = start_gateway({"fake": fake.url})
    pid = gateway.proc.pid
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as asking:
        fds = Path(f"/proc/{pid}/fd")
        deadline = time.monotonic() + 5
        while len(list(fds.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # its own connection accepted
        limit = len(list(fds.iterdir())) + 8
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
        # Take every descriptor left with connections that send nothing.
        idle = [socket.create_connection(("127.0.0.1", gateway.port), timeout=5) for _ in range(16)]
        try:
            deadline = time.monotonic() + 5
            while len(list(fds.iterdir())) < limit and time.monotonic() < deadline:
                time.sleep(0.01)
            request = orjson.dumps(BODY)
            asking.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(request) + request
            )
            answer = asking.recv(65536)
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            while len(body) < length and (more := asking.recv(65536)):
                body += more
            answer = head + b"\r\n\r\n" + body
        finally:
            for sock in idle:
                sock.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"retry-after:" in answer.lower() and b'"code":"overloaded"' in answer
    metrics = httpx.get(gateway.url + "/metrics", trust_env=False).text
    assert "blazar_overloaded_total 1.0" in metrics
    assert 'kind="overloaded"' not in metrics
