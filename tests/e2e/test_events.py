"""``GET /events``, the status page's stream, and the page's files, against a running gateway.

The stream is read as a browser's fetch reads it: a snapshot first, then
each change. The page itself is driven in a real browser by
test_status_page.py, against the real engine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway
from tests.e2e.test_config import hang_up, model_table, write_config
from tests.helpers import Events

CHAT = "/v1/chat/completions"


@pytest.fixture
def events(gateway: Running) -> Iterator[Events]:
    stream = Events(gateway.url)
    yield stream
    stream.close()


def ended_row(events: Events, request_id: str) -> dict[str, Any]:
    """The request's row once it has ended (an earlier event may show it in flight)."""
    data = events.next(
        "activity", lambda data: any(r["id"] == request_id and not r["in_flight"] for r in data["rows"])
    )
    row: dict[str, Any] = next(r for r in data["rows"] if r["id"] == request_id)
    return row


def raw_get(gateway: Running, path: str) -> bytes:
    """GET ``path`` exactly as written (no client library normalising it)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def chat(stream: bool = True, **more: object) -> bytes:
    body: dict[str, object] = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **more}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return orjson.dumps(body)


def test_the_stream_begins_with_the_whole_state(events: Events, gateway: Running, http: httpx.Client) -> None:
    assert events.status == 200
    assert events.headers["content-type"].startswith("text/event-stream")
    snapshot = events.next("snapshot", timeout_s=5)
    assert set(snapshot) == {"gateway", "models", "activity", "series", "logs"}
    (model,) = [m for m in snapshot["models"] if m["id"] == "fake"]
    assert (model["id"], model["kind"], model["state"]) == ("fake", "upstream", "loaded")
    assert model["replicas"][0]["healthy"] is True
    # The same state /v1/models shows: one snapshot for both.
    listed = http.get(gateway.url + "/v1/models").json()["data"]
    assert [(m["id"], m["state"]) for m in listed] == [(m["id"], m["state"]) for m in snapshot["models"]]


def test_a_request_appears_in_the_activity_with_its_tokens(
    events: Events, gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    events.next("snapshot")
    response = http.post(gateway.url + CHAT, content=chat(), headers={"content-type": "application/json"})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    # The usage chunk the engine sent is where the tokens come from.
    usage = [orjson.loads(line[6:]) for line in response.text.splitlines() if '"usage"' in line][-1]["usage"]
    row = ended_row(events, request_id)
    assert (row["model"], row["api"], row["status"], row["stream"]) == ("fake", "chat/completions", 200, True)
    assert row["tokens"] == usage["completion_tokens"] > 0
    assert row["tps"] is not None and row["tps"] > 0
    assert row["bytes"] == len(response.content)
    assert row["replica"] is not None and row["ttft_ms"] is not None and row["duration_ms"] is not None
    # A reply (not a stream) carries its usage at its end as well.
    json_type = {"content-type": "application/json"}
    reply = http.post(gateway.url + CHAT, content=chat(stream=False), headers=json_type)
    reply_id = reply.headers["x-request-id"]
    row = ended_row(events, reply_id)
    assert row["tokens"] == reply.json()["usage"]["completion_tokens"]


def test_a_refused_request_shows_its_error(events: Events, gateway: Running, http: httpx.Client) -> None:
    events.next("snapshot")
    response = http.post(gateway.url + CHAT, content=b'{"model": "nope", "messages": []}')
    assert response.status_code == 404
    request_id = response.headers["x-request-id"]
    row = ended_row(events, request_id)
    assert (row["status"], row["error"], row["tokens"]) == (404, "model_not_found", None)


def test_a_request_under_way_can_be_cancelled(
    events: Events, gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """Cancelled: its upstream connection closes (the engine stops), its client gets an error event."""
    events.next("snapshot")
    headers = {"content-type": "application/json", "x-fake": "chunk-delay=0.2; chunks=200"}
    with (
        httpx.Client(trust_env=False, timeout=10) as client,
        client.stream("POST", gateway.url + CHAT, content=chat(), headers=headers) as response,
    ):
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        row = events.next("activity", lambda data: any(r["id"] == request_id for r in data["rows"]))
        (shown,) = [r for r in row["rows"] if r["id"] == request_id]
        assert shown["in_flight"] is True and shown["cancellable"] is True
        cancel = http.post(f"{gateway.url}/admin/requests/{request_id}/cancel")
        assert cancel.status_code == 200, cancel.text
        assert cancel.json() == {"id": request_id, "cancelled": True}
        rest = "\n".join(lines)
    assert "request_cancelled" in rest
    assert "[DONE]" not in rest
    # The engine saw the gateway hang up: it stops generating.
    record = fake.wait_for_record(
        lambda r: r["headers"].get("x-request-id") == request_id and r["closed_at"] is not None
    )
    assert record["outcome"] == "peer_closed"
    assert record["events_sent"] < 200
    assert ended_row(events, request_id)["error"] == "request_cancelled"
    again = http.post(f"{gateway.url}/admin/requests/{request_id}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "request_not_cancellable"
    unknown = http.post(f"{gateway.url}/admin/requests/no-such-id/cancel")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "request_not_found"
    # A client's id is not echoed whole.
    huge = http.post(f"{gateway.url}/admin/requests/{'x' * 20000}/cancel")
    assert huge.status_code == 404 and len(huge.content) < 2000


def test_the_page_is_served_offline_and_cannot_be_framed(gateway: Running, http: httpx.Client) -> None:
    page = http.get(gateway.url + "/ui")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    # Its own files, from the gateway: nothing from a CDN.
    assert "app.js" in page.text and "app.css" in page.text
    assert "http://" not in page.text and "https://" not in page.text
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        served = http.get(f"{gateway.url}/ui/{name}")
        assert served.status_code == 200 and served.headers["content-type"].startswith(kind)
        assert "https://" not in served.text
    # Only its own three files: no path reaches another (the raw path, as a client could send it).
    for path in ("/ui/..%2F..%2Fpyproject.toml", "/ui/%2E%2E", "/ui/__init__.py", "/ui/secret.txt"):
        answer = raw_get(gateway, path)
        assert answer.startswith(b"HTTP/1.1 404 "), (path, answer[:200])
    assert b"the status page has no file" in raw_get(gateway, "/ui/__init__.py")


def test_with_a_key_the_page_loads_and_its_data_needs_the_key(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client
) -> None:
    fake = start_fake_engine()
    gateway = start_gateway({"fake": fake.url}, "--api-key", "sk-status")
    assert http.get(gateway.url + "/ui").status_code == 200
    assert http.get(gateway.url + "/ui/app.js").status_code == 200
    refused = Events(gateway.url)
    assert refused.status == 401
    refused.close()
    assert http.post(gateway.url + "/admin/requests/x/cancel").status_code == 401
    keyed = Events(gateway.url, {"authorization": "Bearer sk-status"})
    try:
        assert keyed.next("snapshot")["models"][0]["id"] == "fake"
    finally:
        keyed.close()


def test_another_site_cannot_read_the_stream_or_act(gateway: Running, http: httpx.Client) -> None:
    evil = {"origin": "https://evil.example"}
    assert http.get(gateway.url + "/events", headers=evil).status_code == 403
    assert http.post(gateway.url + "/admin/requests/x/cancel", headers=evil).status_code == 403
    assert http.get(gateway.url + "/events", headers={"sec-fetch-site": "cross-site"}).status_code == 403
    # The gateway's own page (same origin) may act: a static upstream has nothing to load.
    own = {"origin": gateway.url, "sec-fetch-site": "same-origin"}
    assert http.post(gateway.url + "/admin/models/fake/load", headers=own).status_code == 409


def test_a_model_change_is_sent_as_it_happens(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client
) -> None:
    """A request in flight shows in its model's counts while it runs, and leaves them when it ends."""
    fake = start_fake_engine()
    gateway = start_gateway({"fake": fake.url})
    stream = Events(gateway.url)
    try:
        stream.next("snapshot")
        headers = {"content-type": "application/json", "x-fake": "prefill=1.5"}
        done = threading.Event()

        def slow() -> None:
            with httpx.Client(trust_env=False, timeout=10) as client:
                client.post(gateway.url + CHAT, content=chat(), headers=headers)
            done.set()

        threading.Thread(target=slow, daemon=True).start()
        busy = stream.next("model", lambda view: view["in_flight"] == 1)
        assert busy["id"] == "fake" and busy["replicas"][0]["in_flight"] == 1
        idle = stream.next("model", lambda view: view["in_flight"] == 0)
        assert idle["state"] == "loaded"
        assert done.wait(5)
    finally:
        stream.close()


def test_a_reload_sends_the_models_it_added_and_removed(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, tmp_path: Path
) -> None:
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path))
    stream = Events(gateway.url)
    try:
        assert [m["id"] for m in stream.next("snapshot")["models"]] == ["a"]
        write_config(path, model_table("b", fake, "bee"))
        assert "reload" in hang_up(gateway)
        added = stream.next("model", lambda view: view["id"] == "b")
        assert added["aliases"] == ["bee"] and added["state"] == "loaded"
        assert stream.next("model_removed") == {"id": "a"}
    finally:
        stream.close()


def test_time_to_first_token_waits_for_the_first_event_with_data(
    events: Events, gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """An engine that answers its head at once and sends `: keepalive` comments through its prefill
    (mlx_lm.server): the first token is the first event with data, not the head."""
    events.next("snapshot")
    headers = {"content-type": "application/json", "x-fake": "prefill=1.0; keepalive=0.1"}
    response = http.post(gateway.url + CHAT, content=chat(), headers=headers, timeout=10)
    assert response.status_code == 200
    assert response.text.startswith(": keepalive")
    request_id = response.headers["x-request-id"]
    row = ended_row(events, request_id)
    assert row["ttft_ms"] >= 1000
    # The access log's ttfb is still the head's (its line is written within 50 ms of the end:
    # the row may come first).
    deadline = time.monotonic() + 5
    while not (lines := [line for line in gateway.log().splitlines() if request_id in line]):
        assert time.monotonic() < deadline, "no access-log line"
        time.sleep(0.05)
    line = lines[-1]
    ttfb_ms = float(line.split("ttfb=", 1)[1].split("ms", 1)[0])
    assert ttfb_ms < 500 < row["ttft_ms"]


def test_cancel_ends_every_request_under_way_with_the_id(
    events: Events, gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """A client may give two requests one x-request-id: the one under way is cancelled though a
    newer one with the same id has ended."""
    events.next("snapshot")
    headers = {"content-type": "application/json", "x-request-id": "job-42"}
    slow = {**headers, "x-fake": "chunk-delay=0.2; chunks=200"}
    with (
        httpx.Client(trust_env=False, timeout=10) as client,
        client.stream("POST", gateway.url + CHAT, content=chat(), headers=slow) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        quick = http.post(gateway.url + CHAT, content=chat(), headers=headers)
        assert quick.status_code == 200 and quick.headers["x-request-id"] == "job-42"
        cancel = http.post(f"{gateway.url}/admin/requests/job-42/cancel")
        assert cancel.status_code == 200, cancel.text
        rest = "\n".join(lines)
    assert "request_cancelled" in rest and "[DONE]" not in rest
