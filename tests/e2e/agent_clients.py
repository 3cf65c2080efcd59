"""The real agent CLIs, Claude Code and Codex, run offline against a local gateway.

scripts/test installs both from npm, at the versions pinned there, into
$BLAZAR_TEST_HOME/agent-clients (kept: a second run installs nothing). This
module finds them and runs one prompt with each, the way a user points them at
a local model, with every setting that keeps them off the network:

- a fresh HOME (and CODEX_HOME) per run, an environment built from nothing (no
  API key, proxy or config of whoever runs the tests leaks in), stdin from
  /dev/null, and a deadline after which the client's process group is killed;
- HTTP(S)_PROXY pointing at an ``OutboundSink`` on 127.0.0.1 that records and
  refuses whatever the client tries to reach beyond the gateway (NO_PROXY
  exempts the loopback): the tests assert it saw nothing;
- where the test process may (root, or CAP_SYS_ADMIN), everything runs in a
  network namespace with only loopback (``loopback_namespace``): the gateway,
  its engine and the client cannot reach anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import h11

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CODEX_PACKAGE = "@openai/codex"
# Set to "required" by scripts/test: a missing client fails the run instead of skipping.
REQUIRED_VAR = "BLAZAR_TEST_AGENT_CLIENTS"
# Generous: a client run on the real engine waits for a two-core CPU to read its prompt.
DEFAULT_TIMEOUT_S = 300.0
API_KEY = "sk-blazar-test"
# The variable Codex reads its key from (config.toml's env_key).
CODEX_KEY_VAR = "BLAZAR_CODEX_KEY"


def clients_dir() -> Path:
    """Where scripts/test installs the clients: $BLAZAR_TEST_HOME/agent-clients."""
    home = os.environ.get("BLAZAR_TEST_HOME") or str(Path.home() / ".cache" / "blazar-test")
    return Path(home) / "agent-clients"


@dataclasses.dataclass(frozen=True)
class AgentClients:
    """The installed binaries and their versions."""

    claude: Path
    codex: Path
    claude_version: str
    codex_version: str


def _package_version(root: Path, package: str) -> str | None:
    try:
        manifest = json.loads((root / "node_modules" / package / "package.json").read_text())
    except (OSError, ValueError):
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None


def find_clients(root: Path | None = None) -> AgentClients | str:
    """The clients installed under ``root`` (default clients_dir()), or why they cannot be used."""
    root = clients_dir() if root is None else root
    bin_dir = root / "node_modules" / ".bin"
    claude, codex = bin_dir / "claude", bin_dir / "codex"
    claude_version = _package_version(root, CLAUDE_CODE_PACKAGE)
    codex_version = _package_version(root, CODEX_PACKAGE)
    missing = [
        f"{package} ({binary})"
        for package, binary, version in (
            (CLAUDE_CODE_PACKAGE, claude, claude_version),
            (CODEX_PACKAGE, codex, codex_version),
        )
        if version is None or not os.access(binary, os.X_OK)
    ]
    if missing or claude_version is None or codex_version is None:
        return (
            f"agent clients not installed in {root}: missing {', '.join(missing)}; scripts/test installs "
            f"them (npm install --prefix {root} {CLAUDE_CODE_PACKAGE}@VERSION {CODEX_PACKAGE}@VERSION)"
        )
    return AgentClients(claude, codex, claude_version, codex_version)


@dataclasses.dataclass(frozen=True)
class ClientRun:
    """What one client run printed, and how it ended."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    timed_out: bool

    def describe(self) -> str:
        """Everything a failed assertion needs to show."""
        status = f"killed after {self.elapsed_s:.0f} s" if self.timed_out else f"exit {self.returncode}"
        return (
            f"{' '.join(self.argv)}: {status} in {self.elapsed_s:.1f} s\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )


def _base_env(home: Path, sink_url: str | None) -> dict[str, str]:
    """A clean environment: nothing of the caller's but PATH."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        # Codex refuses to put its helper binaries under the temporary directory,
        # where pytest's tmp_path lies; a private one keeps the warning away.
        "TMPDIR": str(home / "tmp"),
    }
    if sink_url is not None:
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
            env[name] = sink_url
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    return env


def _run(argv: Sequence[str], env: dict[str, str], cwd: Path, timeout_s: float) -> ClientRun:
    """Run a client in its own process group; kill the group at the deadline."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    finally:
        # Whatever it left behind (a tool's shell, a sandbox helper) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return ClientRun(
        argv=tuple(argv),
        returncode=None if timed_out else proc.returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        elapsed_s=time.monotonic() - started,
        timed_out=timed_out,
    )


def _fresh_home(home: Path) -> Path:
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    work = home / "work"
    work.mkdir(exist_ok=True)
    return work


def claude_env(home: Path, base_url: str, sink_url: str | None, **extra: str) -> dict[str, str]:
    """Claude Code's environment: the gateway as its API, and nothing else to talk to."""
    return {
        **_base_env(home, sink_url),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        # Without it: three CONNECTs to api.anthropic.com:443 per run (telemetry,
        # error reports, the auto-updater, feature flags).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # One try: by default a refused connection is retried for minutes.
        "CLAUDE_CODE_MAX_RETRIES": "0",
        **extra,
    }


def run_claude(
    clients: AgentClients,
    home: Path,
    base_url: str,
    model: str,
    prompt: str,
    *,
    bare: bool = True,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    sink_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ClientRun:
    """``claude -p PROMPT --model MODEL`` against ``base_url`` (the gateway, no /v1).

    ``bare`` adds --bare: 3 tools (Bash, Edit, Read) and a short system prompt
    instead of ~50 KB of them, which a small model's context can hold.
    """
    work = _fresh_home(home)
    argv = [str(clients.claude), "-p", prompt, "--model", model, *(["--bare"] if bare else []), *args]
    return _run(argv, {**claude_env(home, base_url, sink_url), **(env or {})}, work, timeout_s)


def codex_config(
    base_url: str,
    model: str,
    *,
    top: Sequence[str] = (),
    features: Sequence[str] = (),
    tables: Sequence[str] = (),
) -> str:
    """CODEX_HOME/config.toml: the gateway as the only provider, over the Responses API.

    ``top`` are more top-level lines, ``features`` more lines of the
    [features] table, ``tables`` more lines after the provider's table (each
    table with its own header).
    """
    lines = [
        f"model = {json.dumps(model)}",
        'model_provider = "local"',
        "check_for_update_on_startup = false",
        *top,
        "",
        # Off by the command line too (-c analytics.enabled=false --disable
        # plugins); either alone keeps Codex from ab.chatgpt.com (analytics),
        # github.com, api.github.com and chatgpt.com (plugins).
        "[analytics]",
        "enabled = false",
        "",
        "[features]",
        "plugins = false",
        *features,
        "",
        "[model_providers.local]",
        'name = "local"',
        f"base_url = {json.dumps(base_url + '/v1')}",
        'wire_api = "responses"',
        f'env_key = "{CODEX_KEY_VAR}"',
        # One try: a test wants the first failure, not five more. (A refused
        # connection is retried forever all the same, "Reconnecting... waiting
        # for network": the run's deadline ends that.)
        "request_max_retries = 0",
        "stream_max_retries = 0",
        *tables,
    ]
    return "\n".join(lines) + "\n"


def small_model_codex_config(
    home: Path, base_url: str, model: str, instructions: str, context_window: int = 8192
) -> str:
    """codex_config for a model with a small context: Codex's request from ~40 KB down to ~8 KB.

    Its 17 KB of built-in instructions are replaced by ``instructions`` (a
    file in ``home``), and the tools a small model has no use for go: the
    subagent namespace (11 KB), the goal tools, web_search; the environment
    context too.
    """
    home.mkdir(parents=True, exist_ok=True)
    path = home / "instructions.md"
    path.write_text(instructions + "\n")
    top = [
        f"model_instructions_file = {json.dumps(str(path))}",
        f"model_context_window = {context_window}",
        'web_search = "disabled"',
        "include_environment_context = false",
    ]
    features = ["goals = false"]
    tables = ["", "[agents]", "enabled = false"]
    return codex_config(base_url, model, top=top, features=features, tables=tables)


def run_codex(
    clients: AgentClients,
    home: Path,
    base_url: str,
    model: str,
    prompt: str,
    *,
    args: Sequence[str] = (),
    config: str | None = None,
    sink_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ClientRun:
    """``codex exec PROMPT`` with a fresh CODEX_HOME whose config points at ``base_url``.

    The sandbox is danger-full-access: the default (read-only) sandbox runs
    tools in bubblewrap, which needs user namespaces a CI container may lack;
    the gateway is what these runs test, and the network namespace confines
    the tool anyway.
    """
    work = _fresh_home(home)
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(config if config is not None else codex_config(base_url, model))
    env = {**_base_env(home, sink_url), "CODEX_HOME": str(codex_home), CODEX_KEY_VAR: API_KEY}
    argv = [
        str(clients.codex),
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "danger-full-access",
        "-c",
        "analytics.enabled=false",
        "--disable",
        "plugins",
        *args,
        prompt,
    ]
    return _run(argv, env, work, timeout_s)


class OutboundSink:
    """A proxy on 127.0.0.1 that records what a client tried to reach, and refuses it.

    The clients get it as HTTP(S)_PROXY: a CONNECT host:443 or a GET
    http://host/... to anything but the loopback lands here instead of on the
    network, and ``attempts`` lists each request line.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._lock = threading.Lock()
        self._attempts: list[str] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="outbound-sink", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        port: int = self._listener.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    @property
    def attempts(self) -> list[str]:
        with self._lock:
            return list(self._attempts)

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    head = conn.recv(4096)
                except OSError:
                    head = b""
                line = head.split(b"\r\n", 1)[0].decode("latin-1") or "(connected, sent nothing)"
                with self._lock:
                    self._attempts.append(line)
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One HTTP request a client sent through a RecordingRelay, and the reply it got."""

    method: str
    target: str
    request_headers: tuple[tuple[str, str], ...]
    request_body: bytes
    status: int | None
    response_headers: tuple[tuple[str, str], ...]
    response_body: bytes

    def request_json(self) -> object:
        return json.loads(self.request_body) if self.request_body else None

    def sse_data(self) -> list[object]:
        """The JSON of each ``data:`` line of an event-stream reply."""
        data = []
        for line in self.response_body.decode(errors="replace").splitlines():
            payload = line[5:].strip() if line.startswith("data:") else ""
            if payload.startswith("{"):
                data.append(json.loads(payload))
        return data


class RecordingRelay:
    """A TCP relay on 127.0.0.1 in front of the gateway that keeps a copy of both directions.

    The client talks to ``url`` and gets the gateway's bytes unchanged; the
    test reads back each request and reply (``exchanges``): what the client
    sent, how often, and the very text the gateway streamed to it. Each
    direction of each connection keeps at most ``limit_bytes``.
    """

    def __init__(self, target_port: int, limit_bytes: int = 16 * 1024 * 1024) -> None:
        self._target_port = target_port
        self._limit_bytes = limit_bytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._lock = threading.Lock()
        # One (client bytes, gateway bytes) pair per connection, in order of arrival.
        self._connections: list[tuple[bytearray, bytearray]] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="recording-relay", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        port: int = self._listener.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target_port), timeout=10)
            except OSError:
                client.close()
                continue
            pair = (bytearray(), bytearray())
            with self._lock:
                self._connections.append(pair)
            thread = threading.Thread(target=self._relay, args=(client, upstream, pair), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _relay(
        self, client: socket.socket, upstream: socket.socket, pair: tuple[bytearray, bytearray]
    ) -> None:
        """Both directions of one connection, until both ends are done; then close both."""
        with client, upstream:
            upstream.settimeout(None)
            client.settimeout(None)
            back = threading.Thread(target=self._pump, args=(upstream, client, pair[1]), daemon=True)
            back.start()
            self._pump(client, upstream, pair[0])
            back.join()

    def _pump(self, source: socket.socket, sink: socket.socket, copy: bytearray) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    copy += data[: max(0, self._limit_bytes - len(copy))]
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # Pass the half-close on; the other direction goes on until its own end.
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def exchanges(self) -> list[Exchange]:
        """Every request and reply so far, connection by connection."""
        with self._lock:
            connections = [(bytes(a), bytes(b)) for a, b in self._connections]
        return [exchange for sent, received in connections for exchange in _parse_connection(sent, received)]

    def close(self) -> None:
        self._stopping.set()
        self._acceptor.join(5)
        self._listener.close()
        for thread in self._threads:
            thread.join(5)


def _parse_connection(sent: bytes, received: bytes) -> list[Exchange]:
    """The exchanges on one connection, parsed from the bytes of both directions."""
    server = h11.Connection(h11.SERVER)
    client = h11.Connection(h11.CLIENT)
    server.receive_data(sent)
    server.receive_data(b"")
    client_fed = False
    out: list[Exchange] = []
    while True:
        request = _next_message(server)
        if request is None:
            return out
        head, body = request
        assert isinstance(head, h11.Request)
        # The client side is replayed so that h11 knows how the reply is framed.
        client.send(h11.Request(method=head.method, target=head.target, headers=head.headers))
        if body:
            client.send(h11.Data(data=body))
        client.send(h11.EndOfMessage())
        if not client_fed:
            client.receive_data(received)
            client.receive_data(b"")
            client_fed = True
        response = _next_message(client)
        reply, response_body = response if response is not None else (None, b"")
        assert reply is None or isinstance(reply, h11.Response)
        out.append(
            Exchange(
                head.method.decode(),
                head.target.decode(),
                _headers(head.headers),
                body,
                None if reply is None else reply.status_code,
                () if reply is None else _headers(reply.headers),
                response_body,
            )
        )
        if reply is None or client.their_state is not h11.DONE:
            return out
        # The server side is replayed too, so that both sides can start the next cycle.
        server.send(h11.Response(status_code=reply.status_code, headers=reply.headers, reason=reply.reason))
        if response_body and head.method != b"HEAD":
            server.send(h11.Data(data=response_body))
        server.send(h11.EndOfMessage())
        if server.our_state is not h11.DONE or client.our_state is not h11.DONE:
            return out
        server.start_next_cycle()
        client.start_next_cycle()


def _headers(headers: Sequence[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    return tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in headers)


def _next_message(connection: h11.Connection) -> tuple[h11.Request | h11.Response, bytes] | None:
    """The next request or final response and its whole body; None at the end of the bytes."""
    head: h11.Request | h11.Response | None = None
    body = bytearray()
    while True:
        try:
            event = connection.next_event()
        except h11.RemoteProtocolError:
            return (head, bytes(body)) if head is not None else None
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            return (head, bytes(body)) if head is not None else None
        if isinstance(event, h11.Request | h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return head, bytes(body)


# -- a network namespace with only loopback --------------------------------

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _bring_loopback_up() -> None:
    """``ip link set lo up``, without needing iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


@contextlib.contextmanager
def loopback_namespace() -> Iterator[str | None]:
    """Move the calling thread into a new network namespace with only loopback, up.

    Processes it starts meanwhile (gateway, engine, client) live there; on exit
    the thread goes back. Yields None once inside, or why it could not (not
    root, no CAP_SYS_ADMIN in this container): then nothing changes and the
    clients' own settings are all that keeps them offline.
    """
    libc = _libc()
    if not hasattr(libc, "unshare") or not hasattr(libc, "setns"):
        yield "this libc has no unshare/setns"
        return
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(_CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            yield f"unshare(CLONE_NEWNET) failed: {os.strerror(errno)} (needs root or CAP_SYS_ADMIN)"
            return
        try:
            _bring_loopback_up()
            yield None
        finally:
            if libc.setns(original, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original network namespace failed")
    finally:
        os.close(original)


def interfaces() -> list[str]:
    """The network interfaces the calling thread sees (its namespace's)."""
    return sorted(name for _, name in socket.if_nameindex())
