"""CORS: off unless configured, the engine's wildcard never leaks, preflights answered by the gateway."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
APP = "https://app.example.com"


def test_cors_is_off_by_default(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """Without --cors-origin no Access-Control header is sent, whatever the engine says, and pages get 403."""
    response = http.post(gateway.url + CHAT, json=BODY)
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("access-control-")]
    from_page = http.post(gateway.url + CHAT, json=BODY, headers={"origin": APP})
    assert from_page.status_code == 403
    assert not [h for h in from_page.headers if h.startswith("access-control-")]


def test_configured_origin_gets_preflight_and_headers(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """An allowed origin's preflight is answered without a key; its responses carry the CORS headers."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", APP, "--api-key", "k")
    preflight = http.options(
        gateway.url + CHAT,
        headers={
            "origin": APP,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    response = http.post(gateway.url + CHAT, json=BODY, headers={"origin": APP, "authorization": "Bearer k"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in response.headers["access-control-expose-headers"]


def test_other_origins_get_no_cors(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """A preflight from an origin not configured is refused; its requests carry no CORS headers."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", APP)
    evil = "https://evil.example.net"
    preflight = http.options(
        gateway.url + CHAT, headers={"origin": evil, "access-control-request-method": "POST"}
    )
    assert preflight.status_code == 403
    response = http.post(gateway.url + CHAT, json=BODY, headers={"origin": evil})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers
