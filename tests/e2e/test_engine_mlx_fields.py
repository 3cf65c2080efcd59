"""The real mlx_lm.server 0.32.0 behind the gateway: the fields it cannot take never reach it.

Each refused request is checked by its effect on the child: the same process
still serves, and its own log shows no request from it (mlx_lm.server logs a
line for every POST it answers, and a traceback for one it drops).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.test_engine_mlx import DEMO, ENGINE, start_engine_gateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import EngineGateway, engine_home

CHAT = "/v1/chat/completions"
# The served name, which names the child's log file: this module's own.
NAME = "fields-probe"


@pytest.fixture(scope="module")
def gateway(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    gw = start_engine_gateway(logs_dir, "--served-name", NAME)
    yield gw
    gw.stop()


def child_log(gateway: EngineGateway) -> Path:
    """The file the gateway copies the child's output to."""
    return engine_home() / "logs" / f"{ENGINE}--{NAME}.log"


def posts_logged(gateway: EngineGateway) -> int:
    """How many POSTs the child has logged, and no traceback among its lines."""
    text = child_log(gateway).read_text(errors="replace")
    return text.count('"POST /v1/chat/completions') + text.count("Traceback")


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def still_serves(gateway: EngineGateway, http: httpx.Client, pid: int) -> None:
    """The same child process answers a generation through the gateway."""
    assert gateway.child_pid == pid and os.path.exists(f"/proc/{pid}")
    reply = http.post(gateway.url + CHAT, json=chat())
    assert reply.status_code == 200, reply.text


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
        # Token ids past the model's vocabulary (259 here): mlx_lm.server's process dies.
        ("logit_bias", {"99999999": 1}),
        ("logit_bias", {"-300": 1}),
        ("logit_bias", {"300": 1}),
    ],
)
def test_fields_mlx_drops_the_socket_on_are_400s_that_never_reach_it(
    gateway: EngineGateway, field: str, value: Any
) -> None:
    """A value mlx_lm.server's own validation raises on (an empty reply, a 502) is a 400 naming the field."""
    before = posts_logged(gateway)
    with httpx.Client(trust_env=False, timeout=60) as http:
        for stream in (False, True):
            response = http.post(gateway.url + CHAT, json=chat(stream=stream, **{field: value}))
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == field
        time.sleep(0.5)  # a request that had reached the child would be in its log by now
        assert posts_logged(gateway) == before
        still_serves(gateway, http, gateway.child_pid)


@pytest.mark.fault("engines", "requests that would break the engine")
@pytest.mark.parametrize("field", ["draft_model", "adapters"])
def test_fields_that_make_mlx_load_a_model_are_refused(gateway: EngineGateway, field: str) -> None:
    """draft_model or adapters naming a real model directory: a 400, and the child loads nothing."""
    model_dir = str(engine_home() / "models" / DEMO)
    before = posts_logged(gateway)
    with httpx.Client(trust_env=False, timeout=60) as http:
        response = http.post(gateway.url + CHAT, json=chat(stream=True, **{field: model_dir}))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "field_not_allowed"
        assert response.json()["error"]["param"] == field
        time.sleep(0.5)
        assert posts_logged(gateway) == before
        still_serves(gateway, http, gateway.child_pid)


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
def test_content_nested_1000_deep_is_a_400_not_the_engine_s_failure(gateway: EngineGateway) -> None:
    """A content nested 1000 lists deep is a 400 nested_too_deep; mlx_lm.server never parses it."""
    nest = b"[" * 1000 + b"]" * 1000
    body = b'{"model":"' + NAME.encode() + b'","messages":[{"role":"user","content":' + nest + b"}]}"
    before = posts_logged(gateway)
    with httpx.Client(trust_env=False, timeout=60) as http:
        response = http.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "nested_too_deep"
        time.sleep(0.5)
        assert posts_logged(gateway) == before


@pytest.mark.fault("engines", "requests that would break the engine")
def test_nulls_mlx_refuses_are_left_out_and_the_request_is_served(gateway: EngineGateway) -> None:
    """max_tokens, temperature and stream sent as null (OpenAI's default) get a reply, not mlx's empty one."""
    body = orjson.dumps(chat(max_tokens=None, temperature=None, top_p=None, stream=None, seed=None))
    with httpx.Client(trust_env=False, timeout=120) as http:
        response = http.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
