"""A stream the gateway started with heartbeats ends in its API's shape when the engine fails.

Translated, and passed through to an engine that serves the API itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway
from tests.helpers import named_events


@pytest.fixture
def heartbeat_gateway(start_fake_engine: StartFakeEngine, start_gateway: StartGateway) -> Running:
    """A gateway that starts a stream's response itself after 0.2 s without the engine's head."""
    fake: FakeEngine = start_fake_engine()
    return start_gateway({"fake": f"{fake.url}/v1"}, "--sse-heartbeat", "0.2")


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
@pytest.mark.parametrize("fault", ["garbage", "empty", "head=huge"])
@pytest.mark.parametrize(
    ("path", "body", "first", "last"),
    [
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "message_start",
            "error",
        ),
        ("/v1/responses", {"max_output_tokens": 4, "input": "hi"}, "response.created", "response.failed"),
    ],
    ids=["messages", "responses"],
)
def test_translated_head_failure_after_heartbeats_opens_and_ends_the_api_stream(
    heartbeat_gateway: Running, fault: str, path: str, body: dict[str, Any], first: str, last: str
) -> None:
    """An engine whose head fails after the heartbeats began: the API's first event, then its error end."""
    with httpx.Client(trust_env=False, timeout=20) as client:
        reply = client.post(
            heartbeat_gateway.url + path,
            json={"model": "fake", "stream": True, **body},
            headers={"x-fake": f"prefill=1; {fault}"},
        )
    assert reply.status_code == 200 and reply.content.startswith(b": keepalive"), reply.content[:200]
    names = [name for name, _ in named_events(reply.content)]
    assert names[0] == first and names[-1] == last and last not in names[:-1], reply.content[-400:]


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
def test_openai_stream_helper_reads_a_failed_head_after_heartbeats(heartbeat_gateway: Running) -> None:
    """openai's Responses stream helper reads a failed response (was: RuntimeError, no response.created)."""
    with (
        openai.OpenAI(base_url=heartbeat_gateway.url + "/v1", api_key="x", max_retries=0) as client,
        client.responses.stream(
            model="fake", input="hi", max_output_tokens=4, extra_headers={"x-fake": "prefill=1; garbage"}
        ) as stream,
    ):
        kinds = [event.type for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
@pytest.mark.parametrize("fault", ["garbage", "status=500"])
def test_openai_stream_helper_reads_a_failed_passthrough_after_heartbeats(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, tmp_path: Path, fault: str
) -> None:
    """Passed through, a head that fails after the heartbeats: openai's helper reads a failed response."""
    native = start_fake_engine("--native-apis", "responses")
    config = tmp_path / "blazar.toml"
    config.write_text(f'[models.native]\nupstream = "{native.url}/v1"\nnative-apis = ["responses"]\n')
    gateway = start_gateway({}, "--config", str(config), "--sse-heartbeat", "0.2")
    with (
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client,
        client.responses.stream(
            model="native", input="hi", max_output_tokens=4, extra_headers={"x-fake": f"prefill=1; {fault}"}
        ) as stream,
    ):
        kinds = [event.type for event in stream]
    assert kinds == ["response.created", "response.failed"], kinds
