"""engines.home: where blazar keeps engines, models and logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.home import Home, blazar_home


def test_blazar_home_wins() -> None:
    """BLAZAR_HOME is used as given, over XDG_DATA_HOME and HOME."""
    env = {"BLAZAR_HOME": "/srv/blazar", "XDG_DATA_HOME": "/xdg", "HOME": "/home/u"}
    assert blazar_home(env) == Path("/srv/blazar")


def test_xdg_data_home_is_next() -> None:
    """Without BLAZAR_HOME, the home is $XDG_DATA_HOME/blazar."""
    assert blazar_home({"XDG_DATA_HOME": "/xdg", "HOME": "/home/u"}) == Path("/xdg/blazar")


def test_only_home_gives_local_share() -> None:
    """With only HOME set, the home is ~/.local/share/blazar."""
    assert blazar_home({"HOME": "/home/u"}) == Path("/home/u/.local/share/blazar")


def test_empty_values_count_as_unset() -> None:
    """Empty BLAZAR_HOME and XDG_DATA_HOME fall through to the HOME default."""
    env = {"BLAZAR_HOME": "", "XDG_DATA_HOME": "", "HOME": "/home/u"}
    assert blazar_home(env) == Path("/home/u/.local/share/blazar")


def test_tilde_is_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leading ~ in BLAZAR_HOME or XDG_DATA_HOME is expanded to the home directory."""
    monkeypatch.setenv("HOME", "/home/u")
    assert blazar_home({"BLAZAR_HOME": "~/b", "HOME": "/home/u"}) == Path("/home/u/b")
    assert blazar_home({"XDG_DATA_HOME": "~/data", "HOME": "/home/u"}) == Path("/home/u/data/blazar")


def test_tilde_expands_with_the_given_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """~ is expanded with the HOME of the environ passed in, not the process's own."""
    monkeypatch.setenv("HOME", "/somewhere/else")
    assert blazar_home({"BLAZAR_HOME": "~/b", "HOME": "/home/u"}) == Path("/home/u/b")


def test_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With no environ argument, blazar_home reads os.environ."""
    monkeypatch.setenv("BLAZAR_HOME", str(tmp_path))
    assert blazar_home() == tmp_path


def test_home_paths() -> None:
    """Home lays out engines/<name>/{venv,cuda-home,ptx-cache,engine.json}, models, logs and run."""
    home = Home(Path("/b"))
    name = "mlx-0.32.0"
    assert home.engine_dir(name) == Path("/b/engines/mlx-0.32.0")
    assert home.venv(name) == Path("/b/engines/mlx-0.32.0/venv")
    assert home.cuda_home(name) == Path("/b/engines/mlx-0.32.0/cuda-home")
    assert home.ptx_cache(name) == Path("/b/engines/mlx-0.32.0/ptx-cache")
    assert home.manifest(name) == Path("/b/engines/mlx-0.32.0/engine.json")
    assert home.models == Path("/b/models")
    assert home.logs == Path("/b/logs")
    assert home.run == Path("/b/run")


def test_lock_sits_outside_the_engine_directory() -> None:
    """The install lock lives beside the engine directory, so removing the engine keeps the lock."""
    home = Home(Path("/b"))
    lock = home.lock("mlx-0.32.0")
    assert lock == Path("/b/engines/.mlx-0.32.0.lock")
    assert home.engine_dir("mlx-0.32.0") not in lock.parents
