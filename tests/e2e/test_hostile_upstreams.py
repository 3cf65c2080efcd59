"""Upstreams that break the rules: heads too large or ambiguous (502, memory flat), streams without [DONE]."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

pytestmark = pytest.mark.fault


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def ask(gateway: Running, fault: str) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.post(gateway.url + CHAT, json=BODY, headers={"x-fake": fault})


def assert_bad_response(reply: httpx.Response, says: str) -> None:
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] == "upstream_bad_response" and says in error["message"], error


def test_endless_upstream_head_is_a_502_and_memory_stays_flat(gateway: Running, fake: FakeEngine) -> None:
    """Header lines without end: 502 once the head passes 64 KiB, with the gateway's memory flat."""
    ask(gateway, "")  # warm: pools, imports
    before = rss_mib(gateway.proc.pid)
    for _ in range(3):
        assert_bad_response(ask(gateway, "head=endless"), "larger than 65536 bytes")
    grown = rss_mib(gateway.proc.pid) - before
    assert grown < 8, f"the gateway grew by {grown:.1f} MiB"
    assert ask(gateway, "").status_code == 200


def test_a_huge_upstream_header_line_is_not_relayed(gateway: Running, fake: FakeEngine) -> None:
    """One 70 KB header line from the upstream: 502, not relayed to the client."""
    reply = ask(gateway, "head=huge")
    assert_bad_response(reply, "larger than 65536 bytes")
    assert "x-huge" not in reply.headers


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


def test_a_stream_request_answered_without_an_event_stream_is_a_502(
    gateway: Running, fake: FakeEngine
) -> None:
    """A JSON body where the client asked for a stream is not a clean end of no events: 502, saying so."""
    assert_bad_response(stream(gateway, "not-sse"), "not an event stream")
