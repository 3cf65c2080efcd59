"""engines.environment: the child's environment and its run directory."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from engines.environment import ServedNameError, check_served_name, child_env, prepare_run_dir

VENV = Path("/b/engines/mlx-0.32.0/venv")

BASE = {
    "PATH": "/usr/local/bin:/usr/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "PYTHONPATH": "/work/main",
    "PYTHONHOME": "/opt/python",
    "PYTHONSTARTUP": "/home/u/.pythonrc",
    "VIRTUAL_ENV": "/work/main/.venv",
    "CUDA_PATH": "/usr/local/cuda",
    "CUDA_HOME": "/usr/local/cuda",
}


def test_venv_bin_is_first_on_path() -> None:
    """The venv's bin leads PATH, followed by the inherited PATH unchanged."""
    env = child_env(BASE, venv=VENV)
    assert env["PATH"].split(os.pathsep) == [str(VENV / "bin"), "/usr/local/bin", "/usr/bin"]


def test_path_without_inherited_path_is_only_the_venv() -> None:
    """With no inherited PATH, the child's PATH is the venv's bin alone (no empty entry for the cwd)."""
    env = child_env({}, venv=VENV)
    assert env["PATH"] == str(VENV / "bin")


def test_virtual_env_is_the_engine_venv() -> None:
    """VIRTUAL_ENV names the engine's venv, not the gateway's inherited one."""
    assert child_env(BASE, venv=VENV)["VIRTUAL_ENV"] == str(VENV)


def test_leaking_variables_are_dropped() -> None:
    """PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, CUDA_PATH and CUDA_HOME are not inherited."""
    env = child_env(BASE, venv=VENV)
    for key in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "CUDA_PATH", "CUDA_HOME"):
        assert key not in env


def test_unrelated_variables_are_kept() -> None:
    """Variables the child may need (HOME, LANG) pass through unchanged."""
    env = child_env(BASE, venv=VENV)
    assert env["HOME"] == "/home/u"
    assert env["LANG"] == "C.UTF-8"


def test_engine_settings_named_in_drop_are_dropped_in_any_case() -> None:
    """Variables an engine reads as settings (HOST, port, Model) are dropped whatever their case."""
    base = {**BASE, "HOST": "0.0.0.0", "port": "9", "Model": "/x.gguf", "HOSTNAME": "box"}
    env = child_env(base, venv=VENV, drop=("HOST", "PORT", "model"))
    assert "HOST" not in env and "port" not in env and "Model" not in env
    assert env["HOSTNAME"] == "box"
    assert child_env(base, venv=VENV)["HOST"] == "0.0.0.0"


def test_a_name_ending_in_a_star_drops_every_variable_it_begins_in_any_case() -> None:
    """drop=["LLAMA_ARG_*"] drops LLAMA_ARG_CTX_SIZE and llama_arg_x; LLAMA_OTHER and LLAMA_ARG stay."""
    base = {**BASE, "LLAMA_ARG_CTX_SIZE": "1", "llama_arg_x": "2", "LLAMA_OTHER": "3", "LLAMA_ARG": "4"}
    env = child_env(base, venv=VENV, drop=["LLAMA_ARG_*", "HOST"])
    assert "LLAMA_ARG_CTX_SIZE" not in env and "llama_arg_x" not in env
    assert (env["LLAMA_OTHER"], env["LLAMA_ARG"]) == ("3", "4")
    assert env["LANG"] == "C.UTF-8"


def test_cuda_home_and_ptx_cache_only_when_given() -> None:
    """CUDA_HOME and MLX_PTX_CACHE_DIR are set to the engine's own dirs when given, absent otherwise."""
    plain = child_env(BASE, venv=VENV)
    assert "CUDA_HOME" not in plain
    assert "MLX_PTX_CACHE_DIR" not in plain
    cuda = child_env(BASE, venv=VENV, cuda_home=Path("/b/ch"), ptx_cache=Path("/b/ptx"))
    assert cuda["CUDA_HOME"] == "/b/ch"
    assert cuda["MLX_PTX_CACHE_DIR"] == "/b/ptx"
    assert "CUDA_PATH" not in cuda


def test_offline_sets_hub_offline() -> None:
    """offline=True sets HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE); the default sets neither."""
    assert "HF_HUB_OFFLINE" not in child_env(BASE, venv=VENV)
    env = child_env(BASE, venv=VENV, offline=True)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["TRANSFORMERS_OFFLINE"] == "1"


def test_output_is_unbuffered() -> None:
    """PYTHONUNBUFFERED is set so the child's log tail is current."""
    assert child_env(BASE, venv=VENV)["PYTHONUNBUFFERED"] == "1"


def test_env_does_not_mutate_its_input() -> None:
    """child_env returns a new mapping and leaves the base environment untouched."""
    base = dict(BASE)
    env = child_env(base, venv=VENV, cuda_home=Path("/ch"), offline=True)
    assert base == BASE
    assert env is not base


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen2.5-0.5b-instruct-4bit", PurePosixPath("qwen2.5-0.5b-instruct-4bit")),
        (
            "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
            PurePosixPath("mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
        ),
        ("org/name", PurePosixPath("org/name")),
    ],
)
def test_check_served_name_accepts(name: str, expected: PurePosixPath) -> None:
    """Plain and org/name served names become relative paths."""
    assert check_served_name(name) == expected


@pytest.mark.parametrize(
    "name",
    ["", "/abs", "/", "a/../b", "..", "../x", "a//b", ".", "./a", "a/", "x\0y", "a\\b", "..\\x"],
)
def test_check_served_name_rejects(name: str) -> None:
    """Names that are empty, absolute, escape, have empty/dot parts, NULs or backslashes are refused."""
    with pytest.raises(ServedNameError):
        check_served_name(name)


def test_served_name_error_is_a_value_error() -> None:
    """ServedNameError is a ValueError, so callers validating input can catch either."""
    assert issubclass(ServedNameError, ValueError)


def make_model(root: Path, name: str = "model") -> Path:
    """A directory standing in for an MLX model."""
    model = root / name
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return model


def test_prepare_run_dir_creates_the_link(tmp_path: Path) -> None:
    """The run directory gets a symlink named like the served model, pointing at the model directory."""
    model = make_model(tmp_path / "models")
    run_dir = tmp_path / "run" / "child-1"
    prepare_run_dir(run_dir, "qwen", model)
    link = run_dir / "qwen"
    assert link.is_symlink()
    assert link.resolve() == model.resolve()
    assert (link / "config.json").exists()


def test_prepare_run_dir_nests_org_names(tmp_path: Path) -> None:
    """An org/name served name becomes run_dir/org/name, which exists and resolves to the model.

    This is the check mlx_lm.server makes: a local path that exists is loaded, not downloaded.
    """
    model = make_model(tmp_path / "models")
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, "org/name", model)
    assert (run_dir / "org").is_dir()
    assert not (run_dir / "org").is_symlink()
    assert Path(run_dir / "org/name").exists()
    assert Path(run_dir / "org/name").resolve() == model.resolve()


def test_prepare_run_dir_is_idempotent(tmp_path: Path) -> None:
    """Preparing the same run directory twice leaves the same link in place."""
    model = make_model(tmp_path / "models")
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, "org/name", model)
    first = os.readlink(run_dir / "org/name")
    prepare_run_dir(run_dir, "org/name", model)
    assert os.readlink(run_dir / "org/name") == first
    assert sorted(p.name for p in run_dir.iterdir()) == ["org"]


def test_prepare_run_dir_replaces_a_stale_link(tmp_path: Path) -> None:
    """A link left pointing at another (or a vanished) model is replaced by one to the current model."""
    old = make_model(tmp_path / "models", "old")
    new = make_model(tmp_path / "models", "new")
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, "m", old)
    prepare_run_dir(run_dir, "m", new)
    assert (run_dir / "m").resolve() == new.resolve()
    (run_dir / "m").unlink()
    (run_dir / "m").symlink_to(tmp_path / "gone")
    prepare_run_dir(run_dir, "m", new)
    assert (run_dir / "m").resolve() == new.resolve()
    assert old.is_dir()


def test_prepare_run_dir_refuses_a_real_directory(tmp_path: Path) -> None:
    """A real directory at the link's path is refused and left alone, never deleted."""
    model = make_model(tmp_path / "models")
    run_dir = tmp_path / "run"
    squatter = run_dir / "m"
    squatter.mkdir(parents=True)
    (squatter / "keep").write_text("x")
    with pytest.raises(ServedNameError, match="is a directory"):
        prepare_run_dir(run_dir, "m", model)
    assert (squatter / "keep").read_text() == "x"


def test_prepare_run_dir_rejects_escaping_names(tmp_path: Path) -> None:
    """An escaping served name is refused before anything is created outside the run directory."""
    model = make_model(tmp_path / "models")
    run_dir = tmp_path / "run"
    with pytest.raises(ServedNameError):
        prepare_run_dir(run_dir, "../escaped", model)
    assert not (tmp_path / "escaped").exists()


def test_prepare_run_dir_never_writes_into_a_model(tmp_path: Path) -> None:
    """A nested name under an existing model link is refused instead of writing into that model."""
    first = make_model(tmp_path / "models", "first")
    second = make_model(tmp_path / "models", "second")
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, "org", first)
    try:
        with pytest.raises(ServedNameError):
            prepare_run_dir(run_dir, "org/name", second)
    finally:
        assert sorted(p.name for p in first.iterdir()) == ["config.json"]
