"""Bodies sent as forms: curl's default type is served as JSON; a cross-site browser form post is refused."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.e2e.raw_http import payload

CHAT = "/v1/chat/completions"


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
def test_curl_form_content_type_reaches_upstream_as_json(gateway: Running, fake: FakeEngine) -> None:
    """curl's default form type is accepted, and the upstream is told application/json."""
    body = payload(max_tokens=4)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
        )
        assert sock.recv(12) == b"HTTP/1.1 200"
    assert fake.records()[0]["headers"]["content-type"] == "application/json"


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
def test_browser_form_post_is_refused_and_responses_vary_by_origin(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """A browser's form POST (no preflight) never runs a generation; CORS responses vary by Origin."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", "https://app.example.com")
    form = {"content-type": "application/x-www-form-urlencoded"}
    # An origin CORS does not allow is refused before its type is looked at.
    response = http.post(
        gateway.url + CHAT, content=payload(), headers={"origin": "https://evil.example", **form}
    )
    assert response.status_code == 403
    assert response.headers["vary"] == "Origin"
    # An allowed one must send JSON.
    response = http.post(
        gateway.url + CHAT, content=payload(), headers={"origin": "https://app.example.com", **form}
    )
    assert response.status_code == 415
    assert response.headers["vary"] == "Origin"
    assert fake.records() == []
