"""What crosses the gateway, byte for byte and header by header, over real sockets."""

from __future__ import annotations

import base64
import re
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway
from tests.e2e.raw_http import payload, raw_request
from tests.helpers import error_of, free_port, sse_events

CHAT = "/v1/chat/completions"


def chat(model: str = "fake", **fields: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def test_body_bytes_are_forwarded_unchanged(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """The engine receives the client's exact bytes, odd spacing, key order and escapes included."""
    body = (
        b'{ "messages" : [{"role":"user","content":"h\\u00e9llo \xc3\xa9 \\"q\\""}],'
        b'\n  "model":"fake",  "max_tokens":2, "zzz": 1.50 }'
    )
    response = http.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    (record,) = fake.records()
    assert base64.b64decode(record["body_b64"]) == body
    assert record["headers"]["content-length"] == str(len(body))


def test_chunked_client_body_reaches_upstream_with_one_content_length(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """A chunked request body is forwarded with a single Content-Length and no Transfer-Encoding."""
    body = orjson.dumps(chat())

    def pieces() -> Iterator[bytes]:
        yield body[:10]
        yield body[10:]

    response = http.post(gateway.url + CHAT, content=pieces())
    assert response.status_code == 200
    (record,) = fake.records()
    assert record["headers"]["content-length"] == str(len(body))
    assert "transfer-encoding" not in record["headers"]
    assert base64.b64decode(record["body_b64"]) == body


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_hop_by_hop_headers_do_not_cross(gateway: Running, fake: FakeEngine) -> None:
    """Connection, the fields it names, Keep-Alive, TE and Proxy-* stay on the client's hop."""
    body = orjson.dumps(chat())
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Connection: keep-alive, X-Secret-Hop\r\nX-Secret-Hop: 1\r\nKeep-Alive: timeout=5\r\n"
        b"TE: trailers\r\nProxy-Authorization: Basic eA==\r\nUpgrade: h2c\r\n"
        b"Authorization: Bearer k\r\nX-End-To-End: yes\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(request)
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
    assert raw.startswith(b"HTTP/1.1 200")
    (record,) = fake.records()
    sent = record["headers"]
    for name in ("connection", "x-secret-hop", "keep-alive", "te", "proxy-authorization", "upgrade"):
        assert name not in sent, name
    assert sent["host"] == f"127.0.0.1:{fake.port}"
    assert sent["x-end-to-end"] == "yes"
    assert sent["authorization"] == "Bearer k"


def test_response_headers_request_id_and_server_timing(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """Responses carry a new x-request-id (also sent upstream) and Server-Timing with the gateway's time."""
    response = http.post(gateway.url + CHAT, json=chat())
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert fake.records()[0]["headers"]["x-request-id"] == request_id
    timing = response.headers["server-timing"]
    assert re.fullmatch(r"gateway;dur=\d+\.\d{3}, upstream;dur=\d+\.\d{3}", timing), timing
    assert "access-control-allow-origin" not in response.headers
    assert len(response.headers.get_list("date")) == 1


def test_client_request_id_is_echoed(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """A client's x-request-id is kept, on success and on gateway errors alike."""
    ok = http.post(gateway.url + CHAT, json=chat(), headers={"x-request-id": "abc-123"})
    assert ok.headers["x-request-id"] == "abc-123"
    assert fake.records()[0]["headers"]["x-request-id"] == "abc-123"
    missing = http.post(gateway.url + CHAT, json=chat("nope"), headers={"x-request-id": "abc-456"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "abc-456"


def test_stream_headers_and_keepalive_comments(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """An SSE response gets no-cache and X-Accel-Buffering: no, and prefill comments pass through."""
    with http.stream(
        "POST",
        gateway.url + CHAT,
        json=chat(stream=True),
        headers={"x-fake": "prefill=0.3; keepalive=0.1"},
    ) as response:
        raw = response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    events = sse_events(raw)
    assert events[0].startswith(b": keepalive")
    assert events[-1] == b"data: [DONE]"


def test_stream_is_relayed_before_it_ends(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """The first event reaches the client while the engine is still stalled: nothing is buffered."""
    with http.stream(
        "POST", gateway.url + CHAT, json=chat(stream=True, max_tokens=4), headers={"x-fake": "stall=30"}
    ) as response:
        first = next(response.iter_raw())
    assert first.startswith(b"data: {")


@pytest.mark.parametrize(
    "fake_header",
    [
        # The 200 head at once, then the first comment only after 20 s.
        "prefill=30; keepalive=20",
        # The head with half of the first event (one read, over HTTP/1.1), the rest after 20 s.
        "split-first=20",
    ],
)
def test_a_stream_head_is_relayed_before_its_first_event(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, fake_header: str
) -> None:
    """The engine's head reaches the client during its prefill: the gateway holds a head back only
    while a whole event is there to go with it."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url})
    sock = raw_request(gateway, fake_header, payload(stream=True))
    try:
        sock.settimeout(10)
        head = b""
        while b"\r\n\r\n" not in head:
            piece = sock.recv(65536)
            assert piece, head
            head += piece
        status, _, rest = head.partition(b"\r\n")
        assert status == b"HTTP/1.1 200 OK"
        assert b"text/event-stream" in rest.lower()
        assert rest.endswith(b"\r\n\r\n")  # nothing of the body yet
    finally:
        sock.close()


def test_paths_without_v1_are_served(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """/chat/completions and /completions work like their /v1 paths and reach the engine's /v1 routes."""
    assert http.post(gateway.url + "/chat/completions", json=chat()).status_code == 200
    completion = http.post(
        gateway.url + "/completions", json={"model": "fake", "prompt": "x", "max_tokens": 1}
    )
    assert completion.status_code == 200
    assert [r["path"] for r in fake.records()] == ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"", "invalid_json", None),
        (b"[1, 2]", "invalid_json", None),
        (b'{"messages": []}', "missing_model", "model"),
        (b'{"model": 7}', "invalid_model", "model"),
        (b'{"model": "fake", "max_tokens": -1}', "invalid_value", "max_tokens"),
    ],
)
def test_bad_bodies_are_400(
    gateway: Running, fake: FakeEngine, http: httpx.Client, body: bytes, code: str, param: str | None
) -> None:
    """Malformed JSON and a missing or wrong model get 400 in OpenAI's envelope, before any upstream."""
    response = http.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")
    assert fake.records() == []


def test_wrong_method_is_405(gateway: Running, http: httpx.Client) -> None:
    """GET on a relay path is 405 with Allow: POST; PUT on /v1/models is 405 too."""
    response = http.get(gateway.url + CHAT)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert error_of(response)["code"] == "method_not_allowed"
    assert http.put(gateway.url + "/v1/models").status_code == 405


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
def test_wrong_content_type_is_415(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """A body declared as something other than JSON is 415; curl's default form type is accepted."""
    response = http.post(
        gateway.url + CHAT, content=orjson.dumps(chat()), headers={"content-type": "text/plain"}
    )
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"
    curl_like = http.post(
        gateway.url + CHAT,
        content=orjson.dumps(chat()),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert curl_like.status_code == 200


def test_unknown_path_is_openai_404(gateway: Running, http: httpx.Client) -> None:
    """An unknown path is a 404 in OpenAI's envelope, not an HTML page."""
    response = http.post(gateway.url + "/v1/nothing", json={})
    assert response.status_code == 404
    assert error_of(response)["message"] == "Invalid URL (POST /v1/nothing)"


def test_models_endpoints(gateway: Running, http: httpx.Client) -> None:
    """/v1/models lists the routing table in OpenAI's format; /v1/models/{id} takes ids with a slash."""
    listing = http.get(gateway.url + "/v1/models").json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["fake", "org/fake-2"]
    assert all(m["object"] == "model" for m in listing["data"])
    assert http.get(gateway.url + "/v1/models/org/fake-2").json()["id"] == "org/fake-2"
    missing = http.get(gateway.url + "/v1/models/nope")
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"


def test_probes(gateway: Running, http: httpx.Client) -> None:
    """/livez and /readyz answer 200 while the upstream is reachable; /health as the engines' own does."""
    assert http.get(gateway.url + "/livez").status_code == 200
    health = http.get(gateway.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = http.get(gateway.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["models"] == {"fake": "ready", "org/fake-2": "ready"}


def test_readyz_calls_send_nothing_upstream_beyond_the_timed_checks(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, http: httpx.Client
) -> None:
    """/readyz answers from its checks, at most one round per --health-interval: with 20 upstreams
    and an interval of 60 s, 200 calls cost the upstreams one round of 20 (probed per call: 4,000)."""
    fake = start_fake_engine()
    upstreams = {f"m{index}": f"{fake.url}/p{index}/v1" for index in range(20)}
    gw = start_gateway(upstreams, "--health-interval", "60")
    for _ in range(200):
        ready = http.get(gw.url + "/readyz")
        assert ready.status_code == 200, ready.text
    assert ready.json()["models"] == {name: "ready" for name in upstreams}
    checks = [r["path"] for r in fake.records() if r["path"].endswith("/readyz")]
    assert sorted(checks) == sorted(f"/p{index}/readyz" for index in range(20))


def test_readyz_follows_an_upstream_that_goes_away(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, http: httpx.Client
) -> None:
    """An upstream stopped after start is unreachable in /readyz once the next timed check ran."""
    fake = start_fake_engine()
    gw = start_gateway({"m": fake.url}, "--health-interval", "0.3")
    assert http.get(gw.url + "/readyz").status_code == 200
    fake.stop()
    deadline = time.monotonic() + 10
    while (ready := http.get(gw.url + "/readyz")).status_code != 503:
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.05)
    assert ready.json()["models"] == {"m": "unreachable"}
    assert "Connect call failed" in ready.json()["reason"] or "refused" in ready.json()["reason"]


@pytest.mark.fault("clients", "oversized heads and bodies")
def test_body_over_limit_is_413(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """A body past --max-body-bytes is 413, whether declared by Content-Length or streamed chunked."""
    gw = start_gateway({"fake": fake.url}, "--max-body-bytes", "200")
    big = orjson.dumps(chat(padding="x" * 300))
    declared = http.post(gw.url + CHAT, content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and error_of(declared)["code"] == "request_too_large"
    chunked = http.post(gw.url + CHAT, content=iter([big[:150], big[150:]]))
    assert chunked.status_code == 413
    assert http.post(gw.url + CHAT, json=chat()).status_code == 200
    assert len(fake.records()) == 1


@pytest.mark.fault("upstreams", "connection refused")
def test_upstream_down_is_503_with_retry_after(start_gateway: StartGateway, http: httpx.Client) -> None:
    """An upstream that refuses connections gives 503 with Retry-After, and /readyz says why."""
    gw = start_gateway({"gone": f"http://127.0.0.1:{free_port()}"})
    response = http.post(gw.url + CHAT, json=chat("gone"))
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert error_of(response)["code"] == "upstream_unavailable"
    ready = http.get(gw.url + "/readyz")
    assert ready.status_code == 503
    assert "no model can be served now" in ready.json()["reason"]


@pytest.mark.fault("upstreams", "no head before the first-byte timeout")
def test_first_byte_timeout_is_504(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """No response head within --first-byte-timeout gives 504, and the engine's connection is closed."""
    gw = start_gateway({"fake": fake.url}, "--first-byte-timeout", "0.3")
    response = http.post(gw.url + CHAT, json=chat(), headers={"x-fake": "prefill=30"})
    assert response.status_code == 504
    assert error_of(response)["code"] == "upstream_timeout"
    assert "within 0.3 s" in error_of(response)["message"]
    record = fake.wait_for_record(lambda r: r["closed_at"] is not None)
    assert record["outcome"] == "peer_closed"


@pytest.mark.fault("upstreams", "garbage or an empty reply instead of a head")
@pytest.mark.parametrize(
    ("fault", "code"), [("garbage", "upstream_bad_response"), ("reset", "upstream_empty_reply")]
)
def test_broken_upstream_is_502(
    gateway: Running, fake: FakeEngine, http: httpx.Client, fault: str, code: str
) -> None:
    """Garbage bytes and a reset before any response are a 502 with a code naming the failure."""
    response = http.post(gateway.url + CHAT, json=chat(), headers={"x-fake": fault})
    assert response.status_code == 502
    assert error_of(response)["code"] == code


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_non_stream_body_cut_short_is_not_a_clean_response(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """A JSON body cut mid-way by the engine reaches the client as a broken response, never a short 200."""
    with pytest.raises(httpx.RemoteProtocolError):
        http.post(gateway.url + CHAT, json=chat(max_tokens=20), headers={"x-fake": "die-after=1"})


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_truncated_stream_ends_with_error_event(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """A close-delimited stream that ends without [DONE] gets one error event as its last event."""
    response = http.post(
        gateway.url + CHAT, json=chat(stream=True, max_tokens=10), headers={"x-fake": "die-after=2"}
    )
    events = sse_events(response.content)
    assert len(events) == 3
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_truncated"
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_a_stream_sent_with_a_content_length_and_cut_ends_with_an_error_event(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, http: httpx.Client
) -> None:
    """An event stream that an upstream frames with Content-Length reaches the client chunked: whole,
    it is the same events and [DONE] on a connection kept alive; cut short of its length, the client
    gets one error event as its last event, not a broken body."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url})
    whole = http.post(
        gateway.url + CHAT, json=chat(stream=True, max_tokens=4), headers={"x-fake": "sse-length"}
    )
    assert whole.status_code == 200 and "content-length" not in whole.headers
    assert whole.headers["transfer-encoding"] == "chunked"
    assert sse_events(whole.content)[-1] == b"data: [DONE]"
    cut = http.post(
        gateway.url + CHAT,
        json=chat(stream=True, max_tokens=10),
        headers={"x-fake": "sse-length; die-after=2"},
    )
    events = sse_events(cut.content)
    assert len(events) == 3, cut.content
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_truncated", error
    # The gateway's connection to the client survived both.
    assert http.get(gateway.url + "/livez").status_code == 200


def test_keep_alive_upstream_connections_are_pooled(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, http: httpx.Client
) -> None:
    """Against an HTTP/1.1 upstream, sequential requests reuse one pooled connection."""
    fake = start_fake_engine("--http11")
    gw = start_gateway({"fake": fake.url})
    for i in range(10):
        stream = i % 2 == 1
        response = http.post(gw.url + CHAT, json=chat(stream=stream))
        assert response.status_code == 200
        assert response.content.endswith(b"data: [DONE]\n\n") == stream
    records = fake.records()
    assert len(records) == 10
    assert {r["conn_id"] for r in records} == {records[0]["conn_id"]}


def test_environment_proxy_is_ignored(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY and friends in the gateway's environment do not divert upstream traffic."""
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    monkeypatch.setenv("NO_PROXY", "")
    gw = start_gateway({"fake": fake.url})
    assert http.post(gw.url + CHAT, json=chat()).status_code == 200


def test_server_timing_reports_sub_millisecond_gateway_time(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """Server-Timing's gateway figure is a number that clients can read (its size is a benchmark's job)."""
    started = time.perf_counter()
    response = http.post(gateway.url + CHAT, json=chat())
    wall_ms = (time.perf_counter() - started) * 1000
    gateway_ms = float(response.headers["server-timing"].split("dur=")[1].split(",")[0])
    assert 0 < gateway_ms < wall_ms


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        ("POST", CHAT, b'{"model": "nope"}', {}),
        ("POST", CHAT, b"{bad", {}),
        ("POST", CHAT, orjson.dumps(chat()), {"x-fake": "status=404"}),
        ("POST", CHAT, orjson.dumps(chat()), {"x-fake": "empty"}),
        ("GET", "/v1/models", b"", {}),
        ("GET", "/readyz", b"", {}),
        ("GET", "/nothing", b"", {}),
    ],
)
def test_every_response_has_request_id_and_server_timing(
    gateway: Running,
    fake: FakeEngine,
    http: httpx.Client,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> None:
    """Errors, admin routes and relayed responses all carry x-request-id and Server-Timing."""
    response = http.request(method, gateway.url + path, content=body, headers=headers)
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert response.headers["server-timing"].startswith("gateway;dur=")


@pytest.mark.fault("clients", "huge input echoed in an error")
def test_error_messages_echo_client_input_as_a_short_prefix(gateway: Running, http: httpx.Client) -> None:
    """A 10 KiB model name and a 16 KiB path come back in the error cut to a prefix, with their length."""
    long_model = "m" * 10 * 1024
    unknown = http.post(gateway.url + CHAT, json=chat(long_model))
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"
    message = str(error_of(unknown)["message"])
    assert len(message) < 300 and f"({len(long_model)} characters)" in message
    listed = http.get(gateway.url + "/v1/models/" + long_model)
    assert listed.status_code == 404 and len(str(error_of(listed)["message"])) < 300
    long_path = "/" + "p" * 16 * 1024
    lost = http.get(gateway.url + long_path)
    assert lost.status_code == 404 and error_of(lost)["code"] == "unknown_url"
    assert len(str(error_of(lost)["message"])) < 300
    media = http.post(gateway.url + CHAT, content=b"{}", headers={"content-type": "text/" + "x" * 4096})
    assert media.status_code == 415 and len(str(error_of(media)["message"])) < 300


@pytest.mark.fault("clients", "spoofed forwarding and cookies")
def test_cookies_and_client_claimed_forwarding_never_reach_the_engine(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """Cookies are dropped; X-Forwarded-For and Forwarded from an untrusted client become the real peer."""
    claimed = {"cookie": "session=secret", "x-forwarded-for": "6.6.6.6", "forwarded": "for=6.6.6.6"}
    assert http.post(gateway.url + CHAT, json=chat(), headers=claimed).status_code == 200
    seen = fake.records()[-1]["headers"]
    assert "cookie" not in seen and "forwarded" not in seen
    assert seen["x-forwarded-for"] == "127.0.0.1"


@pytest.mark.fault("clients", "spoofed forwarding and cookies")
def test_a_trusted_proxys_chain_reaches_the_engine_with_the_peer_appended(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """From a peer in --forwarded-allow-ips, its X-Forwarded-For goes on with the peer added (as nginx)."""
    trusting = start_gateway({"fake": fake.url}, "--forwarded-allow-ips", "127.0.0.1")
    reply = http.post(trusting.url + CHAT, json=chat(), headers={"x-forwarded-for": "203.0.113.9"})
    assert reply.status_code == 200
    assert fake.records()[-1]["headers"]["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
