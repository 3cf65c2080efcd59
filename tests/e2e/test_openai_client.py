"""The official openai client, sync and async, through the gateway to the fake engine."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway, openai_client

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def client(gateway: Running) -> openai.OpenAI:
    return openai_client(gateway.url)


def async_client(gateway: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False, timeout=10),
    )


def test_sync_chat_completion(gateway: Running, fake: FakeEngine) -> None:
    """A non-streamed chat completion arrives whole, with the model name the client sent."""
    with client(gateway) as c:
        reply = c.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
    assert reply.model == "fake"
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_sync_chat_stream(gateway: Running, fake: FakeEngine) -> None:
    """A streamed chat completion arrives chunk by chunk and ends cleanly."""
    with client(gateway) as c:
        stream = c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_sync_text_completion(gateway: Running, fake: FakeEngine) -> None:
    """The legacy completions endpoint is relayed too."""
    with client(gateway) as c:
        reply = c.completions.create(model="fake", prompt="once", max_tokens=3)
    assert reply.choices[0].text


@pytest.mark.anyio
async def test_async_chat_completion_and_stream(gateway: Running, fake: FakeEngine) -> None:
    """The async client works for both a plain and a streamed request."""
    async with async_client(gateway) as c:
        reply = await c.chat.completions.create(model="org/fake-2", messages=MESSAGES, max_tokens=2)
        assert reply.model == "org/fake-2"
        stream = await c.chat.completions.create(
            model="org/fake-2",
            messages=MESSAGES,
            max_tokens=3,
            stream=True,
        )
        pieces = [ch.choices[0].delta.content async for ch in stream if ch.choices]
    assert len([p for p in pieces if p]) == 3


def test_models_list(gateway: Running) -> None:
    """client.models.list() shows the gateway's routing table."""
    with client(gateway) as c:
        ids = sorted(m.id for m in c.models.list())
        assert ids == ["fake", "org/fake-2"]
        assert c.models.retrieve("org/fake-2").id == "org/fake-2"


def test_unknown_model_is_not_found_error(gateway: Running, fake: FakeEngine) -> None:
    """An unknown model raises NotFoundError with code model_not_found, and the engine never sees it."""
    with client(gateway) as c, pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    assert "nope" in info.value.message
    assert fake.records() == []


@pytest.mark.fault("engines", "requests that would break the engine")
def test_max_tokens_zero_is_bad_request(gateway: Running, fake: FakeEngine) -> None:
    """max_tokens 0, which kills mlx_lm.server's generation thread, is refused at the gateway."""
    with client(gateway) as c, pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=0)
    assert info.value.param == "max_tokens"
    assert fake.records() == []


@pytest.mark.fault("upstreams", "error statuses")
def test_upstream_flat_error_keeps_status_and_message(gateway: Running, fake: FakeEngine) -> None:
    """mlx's flat {"error": "..."} with 404 reaches the client as NotFoundError with its text."""
    with client(gateway) as c, pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            extra_headers={"x-fake": "status=404"},
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["message"] == "fake error"


@pytest.mark.fault("upstreams", "error statuses")
def test_upstream_rate_limit_keeps_retry_after(gateway: Running, fake: FakeEngine) -> None:
    """An upstream 429 stays a 429 with its Retry-After, as RateLimitError."""
    with client(gateway) as c, pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            extra_headers={"x-fake": "status=429"},
        )
    assert info.value.response.headers["retry-after"] == "7"
    assert info.value.type == "rate_limit_error"


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_stream_that_dies_raises_api_error(gateway: Running, fake: FakeEngine) -> None:
    """An upstream that dies mid-stream makes the client raise APIError, not end quietly."""
    with client(gateway) as c:
        stream = c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            max_tokens=50,
            stream=True,
            extra_headers={"x-fake": "die-after=3"},
        )
        received: list[object] = []
        with pytest.raises(openai.APIError, match="without \\[DONE\\]"):
            received.extend(stream)
    assert len(received) == 3


@pytest.mark.fault("upstreams", "garbage or an empty reply instead of a head")
def test_empty_reply_is_internal_server_error_502(gateway: Running, fake: FakeEngine) -> None:
    """An upstream that closes without a response becomes a 502 whose message says so."""
    with client(gateway) as c, pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            extra_headers={"x-fake": "empty"},
        )
    assert info.value.status_code == 502
    assert "without sending a response" in info.value.message


def test_embeddings_not_served_is_not_found(gateway: Running, fake: FakeEngine) -> None:
    """Embeddings against an engine without them get an OpenAI-shaped 404."""
    with client(gateway) as c, pytest.raises(openai.NotFoundError) as info:
        c.embeddings.create(model="fake", input="hi")
    assert isinstance(info.value.body, dict) and "message" in info.value.body


def test_embeddings_relayed_when_served(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """Embeddings are relayed to an upstream that serves them."""
    fake = start_fake_engine("--embeddings")
    gw = start_gateway({"emb": fake.url})
    with client(gw) as c:
        result = c.embeddings.create(model="emb", input="hi")
    assert result.data and len(result.data[0].embedding) > 0
