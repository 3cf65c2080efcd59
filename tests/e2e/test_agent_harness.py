"""The harness the agent-client tests stand on (tests/e2e/agent_clients.py), checked without the clients.

If the relay lost or changed bytes, the sink saw nothing it should see, or the
namespace let a child reach another interface, the client tests would pass
for the wrong reason.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e import agent_clients as ac
from tests.e2e.conftest import StartFakeEngine


def _chat(max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@pytest.mark.parametrize("flags", [(), ("--http11",)], ids=["http10-close", "http11-keepalive"])
def test_recording_relay_passes_bytes_unchanged_and_parses_each_exchange(
    start_fake_engine: StartFakeEngine, flags: tuple[str, ...]
) -> None:
    """The relay hands each reply over unchanged and reads back every request and reply, framed either way."""
    fake = start_fake_engine(*flags)
    relay = ac.RecordingRelay(fake.port)
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            streamed = http.post(f"{relay.url}/v1/chat/completions", json=_chat(3, True))
            whole = http.post(f"{relay.url}/v1/chat/completions", json=_chat(2, False))
        exchanges = relay.exchanges()
    finally:
        relay.close()
    assert [(e.method, e.target, e.status) for e in exchanges] == [
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 200),
    ]
    assert exchanges[0].request_json() == _chat(3, True)
    assert exchanges[0].response_body == streamed.content
    pieces = [e["choices"][0]["delta"].get("content") for e in exchanges[0].sse_data() if isinstance(e, dict)]
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", None]
    assert exchanges[1].response_body == whole.content
    assert whole.json()["choices"][0]["message"]["content"] == "tok0 tok1 "


def test_outbound_sink_records_what_a_client_tried_to_reach() -> None:
    """A client whose proxy is the sink is refused, and the sink names the host it asked for."""
    sink = ac.OutboundSink()
    try:
        with (
            httpx.Client(proxy=sink.url, timeout=5) as http,
            pytest.raises(httpx.ProxyError),
        ):
            http.get("https://telemetry.example.invalid/v1/events")
        assert sink.attempts == ["CONNECT telemetry.example.invalid:443 HTTP/1.1"]
    finally:
        sink.close()


def test_loopback_namespace_leaves_a_child_only_loopback() -> None:
    """Inside, this thread and the processes it starts see only `lo`; outside again, the host's interfaces."""
    before = ac.interfaces()
    with ac.loopback_namespace() as why_not:
        if why_not is not None:
            pytest.skip(f"no network namespace here: {why_not}")
        assert ac.interfaces() == ["lo"]
        child = subprocess.run(
            [sys.executable, "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert child.stdout.strip() == "['lo']"
        with httpx.Client(trust_env=False, timeout=2) as http, pytest.raises(httpx.ConnectError):
            # Nothing listens on loopback here, whatever listens on the host's.
            http.get("http://127.0.0.1:1/")
    assert ac.interfaces() == before
