"""engines/demo_model.py: the random-weight Qwen2 model the tests and benchmarks serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines import demo_model

SCRIPT = Path(demo_model.__file__).resolve()
ENGINE_PYTHON_VAR = "BLAZAR_TEST_ENGINE_PYTHON"

# Run with the engine's python: loads the model's tokenizer offline and with mlx_lm, and
# prints what the test checks as one JSON line.
_ENGINE_CHECK = """
import json, sys
from transformers import AutoTokenizer
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

path = sys.argv[1]
texts = ["Hello, world!", "héllo 日本語 🎉\\n\\ttabs  and  spaces ", "<|im_end|> in text", ""]
tok = AutoTokenizer.from_pretrained(path)
messages = [{"role": "user", "content": "hi"}]
prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
model, wrapper = load(path)
finishes = []
for temp in (0.0, 1.0):
    for r in stream_generate(model, wrapper, "hi", max_tokens=50, sampler=make_sampler(temp=temp)):
        pass
    finishes.append([r.generation_tokens, r.finish_reason])
print(json.dumps({
    "round_trips": [tok.decode(tok.encode(t, add_special_tokens=False)) == t for t in texts],
    "eos_token": tok.eos_token,
    "prompt": prompt,
    "finishes": finishes,
}))
"""


def _engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_presets_are_valid_qwen2_shapes() -> None:
    """Every preset divides its hidden size into heads and its heads into KV groups."""
    assert {"tiny", "bench"} <= set(demo_model.PRESETS)
    for shape in demo_model.PRESETS.values():
        assert shape["hidden_size"] % shape["num_attention_heads"] == 0
        assert shape["num_attention_heads"] % shape["num_key_value_heads"] == 0
        assert shape["num_hidden_layers"] >= 1
        assert shape["intermediate_size"] >= shape["hidden_size"]


def test_tiny_preset_is_the_fast_test_shape() -> None:
    """The tiny preset is hidden 64 with 2 layers, the shape the test suite's timings assume."""
    assert demo_model.PRESETS["tiny"]["hidden_size"] == 64
    assert demo_model.PRESETS["tiny"]["num_hidden_layers"] == 2


def test_dir_name_names_the_preset() -> None:
    """The model directory name is blazar-demo-qwen2-<preset>."""
    assert demo_model.demo_model_dir_name("tiny") == "blazar-demo-qwen2-tiny"
    assert demo_model.demo_model_dir_name("bench") == "blazar-demo-qwen2-bench"


def test_dir_name_rejects_unknown_preset() -> None:
    """An unknown preset is a ValueError that lists the known ones."""
    with pytest.raises(ValueError, match="tiny"):
        demo_model.demo_model_dir_name("huge")


def test_generator_version_is_a_positive_int() -> None:
    """GENERATOR_VERSION is a positive int, so markers compare it exactly."""
    assert isinstance(demo_model.GENERATOR_VERSION, int)
    assert demo_model.GENERATOR_VERSION >= 1


def test_script_imports_and_parses_arguments_without_mlx(tmp_path: Path) -> None:
    """Run by path with numpy, tokenizers and mlx unimportable, the script still imports and parses --help."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'tokenizers', 'mlx', 'mlx_lm', 'transformers'):\n"
        "            raise ImportError(f'{name} is blocked in this test')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    env = {**_engine_env(), "PYTHONPATH": str(tmp_path)}
    code = (
        "import runpy, sys\n"
        f"ns = runpy.run_path({str(SCRIPT)!r}, run_name='demo_model')\n"
        "assert isinstance(ns['PRESETS'], dict) and isinstance(ns['GENERATOR_VERSION'], int)\n"
        "assert ns['demo_model_dir_name']('tiny') == 'blazar-demo-qwen2-tiny'\n"
        "assert 'numpy' not in sys.modules and 'tokenizers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    helped = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], env=env, capture_output=True, text=True, timeout=30
    )
    assert helped.returncode == 0, helped.stderr
    assert "--preset" in helped.stdout


@pytest.mark.skipif(
    not os.environ.get(ENGINE_PYTHON_VAR),
    reason=f"needs an mlx engine venv: set {ENGINE_PYTHON_VAR} to its python (the engine e2e suite does)",
)
def test_tiny_model_is_deterministic_and_its_tokenizer_round_trips(tmp_path: Path) -> None:
    """Tiny written twice is byte-identical, loads offline, round-trips text and honours max_tokens."""
    python = os.environ[ENGINE_PYTHON_VAR]
    env = _engine_env()
    dirs = [tmp_path / "a" / demo_model.demo_model_dir_name("tiny"), tmp_path / "b" / "model"]
    for out in dirs:
        subprocess.run(
            [python, str(SCRIPT), "--out", str(out), "--preset", "tiny", "--seed", "7"],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
    names = sorted(p.name for p in dirs[0].iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert names == sorted(p.name for p in dirs[1].iterdir())
    for name in names:
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name

    before = (dirs[0] / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run(
        [python, str(SCRIPT), "--out", str(dirs[0]), "--preset", "tiny", "--seed", "7"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "is current" in again.stderr
    assert (dirs[0] / "model.safetensors").stat().st_mtime_ns == before

    checked = subprocess.run(
        [python, "-c", _ENGINE_CHECK, str(dirs[0])],
        env={**env, "TMPDIR": str(tmp_path)},
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    assert report["round_trips"] == [True, True, True, True]
    assert report["eos_token"] == "<|im_end|>"
    assert report["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert report["finishes"] == [[50, "length"], [50, "length"]]
