"""From "engine E, model M" to a planned child.

``plan`` resolves everything before the event loop runs (install, built-in model,
run directory, port, argv, environment) into frozen ``ChildConfig`` objects.
In the loop, ``served.ServedModel`` holds the ``Child`` objects of a model and
``registry.Registry`` decides when they run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import socket
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from engines import cudahome
from engines.environment import check_served_name, child_env, prepare_run_dir
from engines.formats import FormatError, detect_format
from engines.home import Home
from engines.install import Installation
from engines.process import ChildConfig
from engines.spec import EngineSpec, SpecError

log = logging.getLogger("blazar.engines")


class PlanError(ValueError):
    """What the user asked for cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class PlannedChild:
    """A child ready to start, and what to tell the user about it."""

    config: ChildConfig
    engine: str
    variant: str
    venv: Path
    cuda_home: Path | None


# Where child ports are drawn from: below the kernel's range for outgoing
# connections, so that no client socket takes a lazily started child's port
# between planning (at startup) and its first start (maybe hours later).
_CHILD_PORTS_LOW = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A port free now on ``host``, outside the range the kernel hands to outgoing connections.

    ``exclude``: ports already planned for other children, free now only
    because those children have not started yet.
    """
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        # Not Linux: macOS and the BSDs hand out 49152-65535.
        ephemeral_low = 49152
    high = ephemeral_low - 1
    if high > _CHILD_PORTS_LOW:
        candidates = range(_CHILD_PORTS_LOW, high + 1)
        for port in random.sample(candidates, min(64, len(candidates))):
            if port in exclude:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    # No such range here (or all taken): any port the kernel offers.
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            chosen: int = sock.getsockname()[1]
        if chosen not in exclude:
            return chosen


def plan(
    spec: EngineSpec,
    installation: Installation,
    home: Home,
    *,
    model: str,
    served_name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    environ: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    withheld_env: Collection[str] = (),
) -> PlannedChild:
    """Resolve one child: run directory, argv, environment, port, log file.

    ``extra_args`` (per-model engine flags from a config file) follow the
    spec's argv; they may not set what the gateway fills in itself (the
    model, its name, the host and the port). ``withheld_env`` names the
    variables of the gateway's own (its settings, the API keys among them)
    that the child must not inherit.
    """
    check_engine_args(spec, extra_args)
    if withheld_env:
        base = os.environ if environ is None else environ
        upper = {name.upper() for name in withheld_env}
        environ = {k: v for k, v in base.items() if k.upper() not in upper}
    if spec.model_field == "alias":
        return _plan_alias(
            spec, installation, home, model, served_name, host, port, environ, tuple(extra_args)
        )
    model_dir = Path(model).expanduser()
    local = model_dir.exists()
    if local:
        if not (model_dir / "config.json").is_file():
            raise PlanError(f"{model_dir} is not a model directory: it has no config.json")
        name = served_name or model_dir.resolve().name
    else:
        # A hub repo: the child downloads it and must be asked by its repo id.
        name = served_name or model
        if name != model:
            raise PlanError(
                f"the name {name!r} differs from the hub repo {model!r}: a hub model is served under "
                "its repo id; download it and give its directory to serve it under another name"
            )
    check_served_name(name)
    child_name = f"{spec.name}--{_slug(name)}"
    # One run directory per (name, model): re-planning a name for other
    # weights (a reload) must not re-point the link a running child uses.
    run_dir = home.run / f"{child_name}--{_digest(str(model_dir.resolve()) if local else model)}"
    if local:
        prepare_run_dir(run_dir, name, model_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    argv = spec.server_argv(
        python=str(installation.python), model=name, host=host, port=port, site_packages=_site(installation)
    )
    env = _env(spec, installation, home, environ, offline=local)
    return _planned(
        spec, installation, home, child_name, name, [*argv, *extra_args], env, run_dir, host, port
    )


def _plan_alias(
    spec: EngineSpec,
    installation: Installation,
    home: Home,
    model: str,
    served_name: str | None,
    host: str,
    port: int | None,
    environ: dict[str, str] | None,
    extra_args: tuple[str, ...],
) -> PlannedChild:
    """A child that serves one local model file under a name it is told (llama-server)."""
    model_path = Path(model).expanduser()
    if not model_path.exists():
        raise PlanError(
            f"{model_path} does not exist; {spec.name} serves a local {' or '.join(spec.model_formats)} "
            "file (it downloads nothing)"
        )
    try:
        found = detect_format(model_path)
    except FormatError as exc:
        raise PlanError(str(exc)) from None
    if found not in spec.model_formats:
        raise PlanError(
            f"{model_path} is a {found} model; {spec.name} serves {', '.join(spec.model_formats)} models"
        )
    model_path = model_path.resolve()
    name = served_name or model_path.stem
    check_served_name(name)
    child_name = f"{spec.name}--{_slug(name)}"
    # No link is needed: the run directory is only the child's working directory.
    run_dir = home.run / child_name
    run_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    argv = spec.server_argv(
        python=str(installation.python),
        model=str(model_path),
        served_name=name,
        host=host,
        port=port,
        site_packages=_site(installation),
    )
    env = _env(spec, installation, home, environ, offline=True)
    return _planned(
        spec, installation, home, child_name, name, [*argv, *extra_args], env, run_dir, host, port
    )


def _env(
    spec: EngineSpec,
    installation: Installation,
    home: Home,
    environ: dict[str, str] | None,
    *,
    offline: bool,
) -> dict[str, str]:
    """The child's environment, made alike for every plan (a symlink's or an alias's)."""
    return child_env(
        os.environ if environ is None else environ,
        venv=installation.venv,
        cuda_home=installation.cuda_home,
        # A CUDA install: mlx compiles its kernels at run time (NVRTC) and
        # caches them under $MLX_PTX_CACHE_DIR; one cache per engine version,
        # so a restarted or second child does not compile them again.
        ptx_cache=home.ptx_cache(spec.name) if installation.cuda_home else None,
        offline=offline,
        drop=spec.env_drop,
    )


def _planned(
    spec: EngineSpec,
    installation: Installation,
    home: Home,
    child_name: str,
    name: str,
    argv: list[str],
    env: dict[str, str],
    run_dir: Path,
    host: str,
    port: int,
) -> PlannedChild:
    config = ChildConfig(
        name=child_name,
        served_model=name,
        argv=tuple(argv),
        env=env,
        cwd=run_dir,
        host=host,
        port=port,
        log_path=home.logs / f"{child_name}.log",
        ready_path=spec.readiness.path,
        ready_max_tokens=spec.readiness.max_tokens,
        ready_timeout_s=spec.readiness.timeout_s,
        health_path=spec.readiness.health_path,
        probe_interval_s=spec.readiness.probe_interval_s,
        probe_timeout_s=spec.readiness.probe_timeout_s,
    )
    return PlannedChild(config, spec.name, installation.variant, installation.venv, installation.cuda_home)


def check_engine_args(spec: EngineSpec, extra_args: Sequence[str]) -> None:
    """Reject extra engine flags that would override what the gateway sets (address, model, name)."""
    if isinstance(extra_args, str) or not all(isinstance(arg, str) for arg in extra_args):
        raise PlanError(f"engine arguments must be a list of strings, not {extra_args!r}")
    reserved = spec.reserved_flags()
    try:
        spec.slots_for(extra_args)
    except SpecError as exc:
        raise PlanError(f"engine argument {exc}") from None
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        # argparse (mlx_lm.server's CLI) also takes a unique prefix of a flag: --po 9 is --port 9.
        long = flag.startswith("--") and len(flag) > 2 and any(r.startswith(flag) for r in reserved)
        if long or flag in reserved:
            raise PlanError(
                f"engine argument {arg!r} would override what the gateway sets itself "
                f"({', '.join(sorted(reserved))})"
            )


def _site(installation: Installation) -> str:
    """The venv's site-packages (where a package's own executables lie), or "" without one."""
    try:
        return str(cudahome.site_packages(installation.venv))
    except FileNotFoundError:
        return ""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"
