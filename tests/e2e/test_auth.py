"""API keys: who gets in, what the engine sees, and what the error says."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway, openai_client

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def guarded(start_gateway: StartGateway, fake: FakeEngine, tmp_path: Path) -> Running:
    """A gateway with two keys on the command line and one from a key file."""
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's key\nkey-from-file\n\n")
    return start_gateway(
        {"fake": fake.url}, "--api-key", "key-one", "--api-key", "key-two", "--api-key-file", str(key_file)
    )


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": "Bearer key-one"},
        {"authorization": "bearer key-two"},
        {"x-api-key": "key-from-file"},
    ],
)
def test_a_configured_key_gets_in(
    guarded: Running, fake: FakeEngine, http: httpx.Client, headers: dict[str, str]
) -> None:
    """Bearer or x-api-key with any configured key is relayed, and the engine never sees the key."""
    response = http.post(guarded.url + CHAT, json=BODY, headers=headers)
    assert response.status_code == 200
    seen = fake.records()[0]["headers"]
    assert "authorization" not in seen and "x-api-key" not in seen


@pytest.mark.parametrize(
    "fields",
    [b"", b"Authorization: Bearer wrong-key\r\n", b"Origin: https://evil.example\r\n"],
    ids=["no key", "a wrong key", "a foreign page with no key"],
)
def test_a_head_refused_is_answered_before_its_body_comes(guarded: Running, fields: bytes) -> None:
    """Refused at its head, as soon as it is whole: its body (clients such as httpx send it
    apart) is not waited for, and holds none of the gateway's body budget meanwhile."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n%b\r\n{" % fields
        )
        answer = sock.recv(65536)
    assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 403 Forbidden"), answer


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong-key"},
        {"authorization": "Basic a2V5LW9uZQ=="},
        {"x-api-key": "key-on"},
    ],
)
def test_a_missing_or_bad_key_is_401(
    guarded: Running, fake: FakeEngine, http: httpx.Client, headers: dict[str, str]
) -> None:
    """No key, a wrong one or another scheme gets 401 in OpenAI's envelope, without echoing the key."""
    response = http.post(guarded.url + CHAT, json=BODY, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
    for value in headers.values():
        assert value.split()[-1] not in response.text
    assert fake.records() == []


def test_probes_need_no_key_but_models_do(guarded: Running, http: httpx.Client) -> None:
    """/livez, /readyz, /health and / (GET and HEAD) answer without a key; /v1/models does not."""
    assert http.head(guarded.url + "/").status_code == 200
    assert http.get(guarded.url + "/").json() == {"status": "ok"}
    assert http.get(guarded.url + "/livez").status_code == 200
    assert http.get(guarded.url + "/health").status_code == 200
    assert http.get(guarded.url + "/readyz").status_code == 200
    assert http.get(guarded.url + "/v1/models").status_code == 401
    assert http.get(guarded.url + "/v1/models", headers={"x-api-key": "key-one"}).status_code == 200


def test_openai_client_with_wrong_key_raises_authentication_error(guarded: Running) -> None:
    """openai-python maps the 401 to AuthenticationError; with the right key it works."""
    with openai_client(guarded.url) as c:
        c.api_key = "nope"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        c.api_key = "key-one"
        assert [m.id for m in c.models.list()] == ["fake"]


def test_without_keys_the_clients_authorization_goes_upstream(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """With no keys configured the gateway checks nothing, and an upstream's own key passes through."""
    assert (
        http.post(gateway.url + CHAT, json=BODY, headers={"authorization": "Bearer upstream-key"}).status_code
        == 200
    )
    assert fake.records()[0]["headers"]["authorization"] == "Bearer upstream-key"
