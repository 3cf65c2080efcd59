"""The gateway's own environment is closed to the other processes of its user (Linux).

An engine child runs as the gateway's user; its environment is scrubbed of
BLAZAR_API_KEY, but it could read the key from the gateway's own
/proc/<pid>/environ. The gateway makes itself non-dumpable at start, which
closes that file (and ptrace) to everyone but root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ROOT, FakeEngine
from tests.helpers import free_port, terminate

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the gateway as another user: needs Linux, root and setpriv (util-linux)",
)

_NOBODY = "65534"
# Run as the unprivileged user, without root's groups.
_AS_NOBODY = ["setpriv", "--reuid", _NOBODY, "--regid", _NOBODY, "--clear-groups"]

# Run as the same user as the gateway: what /proc/<pid>/environ (and a thread's) gives it.
_READER = """
import sys
key = sys.argv[1].encode()
for path in sys.argv[2:]:
    try:
        data = open(path, "rb").read()
    except PermissionError:
        print("denied")
    else:
        print("read-the-key" if key in data else "read-no-key")
"""


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    """A home the unprivileged user may write (pytest's own tmp dirs are root's alone)."""
    home = Path(tempfile.mkdtemp(prefix="blazar-nobody-"))
    home.chmod(0o777)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_another_process_of_the_gateways_user_cannot_read_its_environ(
    fake: FakeEngine, nobody_home: Path, logs_dir: Path
) -> None:
    """Run as uid 65534, the gateway's /proc/<pid>/environ holding BLAZAR_API_KEY is denied to uid 65534."""
    hidden = [p for p in (ROOT, Path(sys.executable)) if not _others_can_reach(p)]
    if hidden:
        # A checkout in a private folder (mktemp -d makes 0700 ones): uid 65534 cannot import the gateway.
        pytest.skip(f"uid {_NOBODY} cannot read {hidden[0]}: check out into a folder others can read")
    secret = f"sk-{uuid.uuid4().hex}"
    port = free_port()
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "HOME": str(nobody_home),
        "BLAZAR_HOME": str(nobody_home / "blazar"),
        "BLAZAR_API_KEY": secret,
    }
    argv = [sys.executable, "-m", "proxy", "--log-level", "warning", "--port", str(port)]
    log_path = logs_dir / f"gateway-nobody-{port}.log"
    with log_path.open("wb") as log:
        # setpriv execs the gateway: the pid is the gateway's own.
        proc = subprocess.Popen(
            [*_AS_NOBODY, *argv, "--upstream", f"fake={fake.url}"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        with httpx.Client(trust_env=False, timeout=5) as http:
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if http.get(f"{url}/livez").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"the gateway did not start: {log_path.read_text()}"
                time.sleep(0.05)
            uids = next(
                line
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")
            )
            assert uids.split()[1:] == [_NOBODY] * 4, uids
            # The key still guards the gateway, which still relays.
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            assert http.post(f"{url}/v1/chat/completions", json=body).status_code == 401
            answered = http.post(
                f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}
            )
            assert answered.status_code == 200, answered.text
        # The process itself and its main thread, as the reader sees them.
        paths = [f"/proc/{proc.pid}/environ", f"/proc/{proc.pid}/task/{proc.pid}/environ"]
        read = subprocess.run(
            [*_AS_NOBODY, sys.executable, "-c", _READER, secret, *paths],
            env={"PATH": os.environ["PATH"], "HOME": str(nobody_home)},
            capture_output=True,
            timeout=30,
            check=True,
        )
        assert read.stdout.decode().split() == ["denied", "denied"], read.stdout.decode()
    finally:
        terminate(proc, 15)


def _others_can_reach(path: Path) -> bool:
    """Whether a user who owns nothing of it can reach ``path`` (every folder on the way searchable
    by others, the path itself readable by them)."""
    path = path.absolute()
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    return all(os.stat(folder).st_mode & stat.S_IXOTH for folder in path.parents)
