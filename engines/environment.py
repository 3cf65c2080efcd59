"""What a child starts with: its environment and its run directory. Pure where possible."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path, PurePosixPath

# Inherited variables that would make the child import the gateway's
# packages, or another Python's, instead of its venv's.
_NOT_INHERITED = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "CUDA_PATH", "CUDA_HOME"}
)


class ServedNameError(ValueError):
    """A served model name that cannot be a path inside the run directory."""


def child_env(
    base: Mapping[str, str],
    *,
    venv: Path,
    cuda_home: Path | None = None,
    ptx_cache: Path | None = None,
    offline: bool = False,
    drop: Collection[str] = (),
) -> dict[str, str]:
    """The child's environment: the venv first on PATH, its own CUDA_HOME, nothing that leaks in.

    ``drop`` names variables the engine reads as settings (its spec's
    ``server.env_drop``), matched in any case; a name ending in ``*`` drops
    every variable it begins (llama-server reads each flag from a
    ``LLAMA_ARG_*`` variable).
    """
    dropped = {name.upper() for name in drop if not name.endswith("*")}
    prefixes = tuple(name[:-1].upper() for name in drop if name.endswith("*"))
    env = {
        k: v
        for k, v in base.items()
        if k not in _NOT_INHERITED and k.upper() not in dropped and not k.upper().startswith(prefixes)
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *filter(None, [base.get("PATH", "")])])
    env["PYTHONUNBUFFERED"] = "1"
    if cuda_home is not None:
        env["CUDA_HOME"] = str(cuda_home)
    if ptx_cache is not None:
        env["MLX_PTX_CACHE_DIR"] = str(ptx_cache)
    if offline:
        # A local model needs no hub; never let a mistyped name download.
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def check_served_name(name: str) -> PurePosixPath:
    """The served name as a relative path (``org/name`` nests); reject what would escape."""
    if not name or "\0" in name or name.startswith("/") or "\\" in name:
        raise ServedNameError(f"served name {name!r} cannot name a path in the run directory")
    path = PurePosixPath(name)
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ServedNameError(f"served name {name!r} has an empty, '.' or '..' component")
    return path


def prepare_run_dir(run_dir: Path, served_name: str, model_dir: Path) -> None:
    """Make ``run_dir`` hold a symlink named like the served model, pointing at the model.

    mlx_lm.server loads whatever the request's ``model`` names and checks the
    local path first: started here with ``--model <served name>``, it serves
    the client's own name byte for byte and echoes it back.
    """
    relative = check_served_name(served_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / relative
    parent = run_dir
    for part in relative.parts[:-1]:
        parent = parent / part
        if parent.is_symlink():
            # Another served name's link: going through it would write
            # into that model's directory.
            raise ServedNameError(f"served name {served_name!r} would nest inside the link {parent}")
        parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.is_symlink() and Path(os.readlink(link)) == model_dir.resolve():
            return
        if link.is_dir() and not link.is_symlink():
            raise ServedNameError(f"{link} is a directory, not the model link")
        link.unlink()
    link.symlink_to(model_dir.resolve(), target_is_directory=True)
