"""The mistakes a newcomer makes pointing an agent client at the gateway, answered with what to do."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import Running


@pytest.mark.parametrize(
    ("path", "anthropic"),
    [("/v1/v1/messages", True), ("/v1/v1/messages/count_tokens", True), ("/v1/v1/chat/completions", False)],
)
def test_a_base_url_with_v1_twice_is_told_to_drop_it(
    gateway: Running, http: httpx.Client, path: str, anthropic: bool
) -> None:
    """ANTHROPIC_BASE_URL=.../v1 makes Claude Code post to /v1/v1/messages: a 404 in that API's envelope
    saying to give the address without /v1."""
    reply = http.post(gateway.url + path, json={"model": "fake", "max_tokens": 4, "messages": []})
    assert reply.status_code == 404
    doc = reply.json()
    if anthropic:
        assert doc["type"] == "error" and doc["error"]["type"] == "not_found_error", doc
    else:
        assert doc["error"]["code"] == "unknown_url", doc
    assert "without /v1" in doc["error"]["message"] and "ANTHROPIC_BASE_URL" in doc["error"]["message"]


def test_an_unknown_model_is_answered_with_the_models_served(gateway: Running, http: httpx.Client) -> None:
    """Claude Code's default model name (not served here): the 404 names the models that are."""
    body = {"model": "claude-opus-5-5", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    reply = http.post(gateway.url + "/v1/messages", json=body)
    assert reply.status_code == 404
    message = reply.json()["error"]["message"]
    assert "claude-opus-5-5" in message and "the models served here: fake" in message, message
