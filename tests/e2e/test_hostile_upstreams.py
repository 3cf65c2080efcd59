"""Upstreams whose response heads break the rules get a 502, and cost the gateway no memory."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import FakeEngine, Running

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
