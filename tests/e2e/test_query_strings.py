"""A client's query string stays at the gateway: openai.AzureOpenAI (``?api-version=``) through it."""

from __future__ import annotations

import socket

import openai
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

BODY = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def azure_client(gateway: Running, api_key: str = "unused") -> openai.AzureOpenAI:
    """The official Azure client as a user would point it at the gateway (its deployment is the model)."""
    return openai.AzureOpenAI(
        azure_endpoint=gateway.url,
        api_version="2024-10-21",
        api_key=api_key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=10),
    )


def test_a_query_string_is_not_passed_to_the_upstream(gateway: Running, fake: FakeEngine) -> None:
    """``/v1/chat/completions?api-version=…`` is answered 200; the engine sees the path without the query
    (mlx_lm.server, which the fake engine copies, answers 404 to one with a query)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions?api-version=2024-10-21&x=%%2F HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % len(BODY)
            + BODY
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert [r["path"] for r in fake.records()] == ["/v1/chat/completions"]


def test_the_azure_openai_client_chats_and_streams_through_the_gateway(
    gateway: Running, fake: FakeEngine
) -> None:
    """openai.AzureOpenAI (deployment paths, ?api-version=) gets a completion and a stream from the engine."""
    with azure_client(gateway) as client:
        reply = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content and reply.model == "fake"
        chunks = list(
            client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        text = client.completions.create(model="fake", prompt="once", max_tokens=2)
        assert text.choices[0].text
    assert {r["path"] for r in fake.records()} == {"/v1/chat/completions", "/v1/completions"}


@pytest.mark.fault("clients", "spoofed forwarding and cookies")
def test_the_azure_api_key_header_is_checked_and_not_forwarded(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """With --api-key, Azure's ``api-key`` header is checked (wrong: 401) and never reaches the engine."""
    gateway = start_gateway({"fake": fake.url}, "--api-key", "sekret")
    with azure_client(gateway, api_key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    with azure_client(gateway, api_key="sekret") as client:
        reply = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
    (record,) = fake.records()
    assert "api-key" not in {name.lower() for name in record["headers"]}, record["headers"]


def test_an_unknown_deployment_endpoint_is_a_404(gateway: Running, fake: FakeEngine) -> None:
    """A deployment path that names no relayed endpoint is the gateway's own 404, not relayed."""
    with azure_client(gateway) as client, pytest.raises(openai.NotFoundError):
        client.images.generate(model="fake", prompt="a cat")
    assert fake.records() == []
