"""What reaches an engine: the fields its spec declares, checked, and the client's bytes, kept.

The fake engine stands in for mlx_lm.server behind a model configured with
`engine = "mlx-0.32.0"`: it records the bytes it was sent, and it closes the
socket without a reply on the field values mlx_lm.server cannot take, as the
real one does (test_engine_mlx.py shows the same on the real engine).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.payload import MAX_DEPTH
from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway

BIG = b"123456789012345678901234567890"
CHAT = "/v1/chat/completions"


@pytest.fixture
def mlx_fake(start_fake_engine: StartFakeEngine) -> FakeEngine:
    return start_fake_engine()


@pytest.fixture
def gateway(mlx_fake: FakeEngine, start_gateway: StartGateway, tmp_path: Path) -> Running:
    """Models m (alias a) and loader (allows adapters), both mlx-0.32.0 specs, served by the fake."""
    path = tmp_path / "blazar.toml"
    path.write_text(
        f'[models.m]\nupstream = "{mlx_fake.url}/v1"\nengine = "mlx-0.32.0"\naliases = ["a"]\n\n'
        f'[models.loader]\nupstream = "{mlx_fake.url}/v1"\nengine = "mlx-0.32.0"\n'
        'allow-fields = ["adapters"]\n',
        encoding="utf-8",
    )
    return start_gateway({}, "--config", str(path))


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=30) as client:
        yield client


def sent(fake: FakeEngine) -> list[bytes]:
    """The bodies the engine received, in order."""
    return [base64.b64decode(r["body_b64"]) for r in fake.records() if r["path"] == CHAT]


def post(http: httpx.Client, gateway: Running, body: bytes) -> httpx.Response:
    return http.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"})


def chat(model: str = "m", **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


@pytest.mark.fault("engines", "requests that would break the engine")
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("xtc_probability", 0),
        ("xtc_threshold", 0),
        ("repetition_context_size", -1),
        ("num_draft_tokens", "x"),
        ("adapters", 5),
        ("top_k", -1),
        ("logit_bias", {"x": 1}),
    ],
)
def test_wrong_types_mlx_would_drop_the_socket_on_are_400s_before_the_engine(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client, field: str, value: Any
) -> None:
    """A field of a type or range mlx_lm.server cannot take is a 400 naming it; the engine sees nothing."""
    response = post(http, gateway, chat(stream=True, **{field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # adapters is refused for what it is before its type is looked at.
    assert error["param"] == field and error["code"] in ("invalid_type", "field_not_allowed")
    assert sent(mlx_fake) == []


@pytest.mark.fault("engines", "requests that would break the engine")
def test_logit_bias_is_refused_where_the_model_s_vocabulary_is_unknown(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client
) -> None:
    """A static upstream named an mlx engine has no config.json to read: an id past its vocabulary
    would SIGSEGV mlx_lm.server, and none can be checked, so a non-empty logit_bias is a 400; {} passes."""
    response = post(http, gateway, chat(stream=True, logit_bias={"2147483647": 5}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"
    assert "vocabulary size is unknown" in response.json()["error"]["message"]
    assert sent(mlx_fake) == []
    assert post(http, gateway, chat(stream=True, max_tokens=2, logit_bias={})).status_code == 200


@pytest.mark.fault("engines", "requests that would break the engine")
@pytest.mark.parametrize("field", ["draft_model", "adapters"])
def test_fields_that_make_mlx_load_something_are_refused_unless_the_model_allows_them(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client, field: str
) -> None:
    """draft_model or adapters naming a directory: 400 field_not_allowed; a model allowing it sends it on."""
    response = post(http, gateway, chat(stream=True, **{field: "/etc"}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["code"] == "field_not_allowed"
    assert sent(mlx_fake) == []
    allowed = post(http, gateway, chat("loader", stream=True, adapters="/srv/adapters"))
    assert allowed.status_code == 200, allowed.text
    assert orjson.loads(sent(mlx_fake)[0])["adapters"] == "/srv/adapters"


def test_a_body_that_passes_goes_on_byte_for_byte_but_for_the_nulls_the_engine_cannot_take(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client
) -> None:
    """Spacing, escapes and a 30-digit number reach the engine as sent; only temperature: null is left out."""
    body = (
        b'{ "model" : "m",\n  "messages": [{"role": "user", "content": "caf\\u00e9 \\"}\\""}],\n'
        b'  "temperature": null, "stream": true, "user_tag": ' + BIG + b', "top_p": 1.0e0 }'
    )
    response = post(http, gateway, body)
    assert response.status_code == 200, response.text
    assert sent(mlx_fake) == [body.replace(b'  "temperature": null, ', b"  ")]


def test_an_alias_renames_the_model_and_keeps_every_number_exactly(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client
) -> None:
    """An alias's request reaches the engine with model renamed and a 30-digit integer as written."""
    body = b'{"model":"a","messages":[{"role":"user","content":"hi"}],"stream":true,"user_tag":' + BIG + b"}"
    response = post(http, gateway, body)
    assert response.status_code == 200, response.text
    assert sent(mlx_fake) == [body.replace(b'"model":"a"', b'"model":"m"')]


def test_a_non_stream_request_sent_as_a_stream_keeps_the_client_s_bytes(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client
) -> None:
    """Non-stream to mlx goes as a stream: stream set in place, stream_options added, the rest as sent."""
    body = b'{"model":"m","stream":false,"messages":[{"role":"user","content":"hi"}],"user_tag":' + BIG + b"}"
    response = post(http, gateway, body)
    assert response.status_code == 200, response.text
    assert "choices" in response.json()
    expected = (
        body.replace(b'"stream":false', b'"stream":true')[:-1] + b',"stream_options":{"include_usage":true}}'
    )
    assert sent(mlx_fake) == [expected]


def deep(model: str, depth: int, **extra: Any) -> bytes:
    """A chat body whose message content nests ``depth`` lists (the whole body 3 more)."""
    tail = b"".join(b"," + orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in extra.items())
    nest = b"[" * depth + b"]" * depth
    return (
        b'{"model":"'
        + model.encode()
        + b'","messages":[{"role":"user","content":'
        + nest
        + b"}]"
        + tail
        + b"}"
    )


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
@pytest.mark.parametrize(
    ("model", "depth", "extra"),
    [
        ("a", 300, {"stream": True}),  # an alias: rewritten
        ("m", 300, {}),  # a non-stream request: sent as a stream, rewritten
        ("m", 300, {"stream": True}),  # neither: sent as it is
        ("m", 1030, {"stream": True}),  # past the parser's own limit
        ("m", MAX_DEPTH - 2, {"stream": True}),  # just past the gateway's
    ],
)
def test_a_body_nested_too_deep_is_one_clear_400_on_every_path(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client, model: str, depth: int, extra: dict[str, Any]
) -> None:
    """Past MAX_DEPTH levels, rewritten or not, the answer is one OpenAI 400 and the engine sees nothing."""
    response = post(http, gateway, deep(model, depth, **extra))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "nested_too_deep"
    assert sent(mlx_fake) == []
    at_limit = post(http, gateway, deep(model, MAX_DEPTH - 3, **extra))
    assert at_limit.status_code == 200, at_limit.text


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.fault("overload", "request bodies past the gateway's budget")
def test_splice_of_an_emoji_body_does_not_multiply_the_gateway_s_memory(
    gateway: Running, mlx_fake: FakeEngine, http: httpx.Client
) -> None:
    """A 12 MB chat with an emoji and "stream": false, sent to an alias of an mlx model, is spliced
    without the gateway's peak memory growing past 10x the body (the whole-str splice grew it ~20x)."""
    content = "x" * 12_000_000 + "😀"
    body = orjson.dumps({"model": "a", "stream": False, "messages": [{"role": "user", "content": content}]})
    post(http, gateway, chat())  # the gateway's own start-up peak, before the measure
    before = peak_rss_bytes(gateway.proc.pid)
    response = post(http, gateway, body)
    grown = peak_rss_bytes(gateway.proc.pid) - before
    assert response.status_code == 200, response.text
    received = orjson.loads(sent(mlx_fake)[-1])
    assert (received["model"], received["stream"]) == ("m", True)
    assert received["messages"][0]["content"] == content
    assert grown < 10 * len(body), f"the gateway's peak grew {grown / len(body):.1f}x the body"
