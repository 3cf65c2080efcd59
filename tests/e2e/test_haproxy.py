"""Two gateways behind a real HAProxy, configured by the shipped deploy/haproxy.cfg.

The config is rendered with this test's ports, plus two lines for the test
only: an admin socket, through which the tests read HAProxy's own view of the
gateways (UP/DOWN, what its checks saw, retries) and pause a gateway's checks
to isolate the retry path from the check path; and a log on stderr. Every
request sent through HAProxy is checked whole: status, every event of a
stream, the generated text.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.client import HTTPResponse
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.balancers import (
    CHAT,
    counted,
    in_flight,
    replace_once,
    served_ids,
    start_pair,
    wait_listening,
)
from tests.e2e.conftest import ROOT, FakeEngine, Running, StartGateway
from tests.helpers import free_port, wait_until

HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
# A stream of 20 tokens, 0.1 s apart: long enough to be in flight when a
# gateway is told to stop.
STREAM_CHUNKS = 20
STREAM_FAKE = f"chunks={STREAM_CHUNKS}; chunk-delay=0.1"
TEXT_FAKE = f"chunks={STREAM_CHUNKS}; prefill=0.2"
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(STREAM_CHUNKS))


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)


def render_haproxy(work: Path, listen: int, backends: list[int], admin_port: int) -> Path:
    """deploy/haproxy.cfg with this test's ports, an admin socket, and a log on stderr."""
    text = HAPROXY_CFG.read_text()
    text = replace_once(text, "bind 127.0.0.1:8000", f"bind 127.0.0.1:{listen}")
    text = replace_once(text, "server gw1 127.0.0.1:8001", f"server gw1 127.0.0.1:{backends[0]}")
    text = replace_once(text, "server gw2 127.0.0.1:8002", f"server gw2 127.0.0.1:{backends[1]}")
    text = replace_once(
        text,
        "\nglobal\n",
        f"\nglobal\n    stats socket ipv4@127.0.0.1:{admin_port} level admin\n"
        "    log stderr format raw local0 info\n",
    )
    text = replace_once(text, "\ndefaults\n", "\ndefaults\n    log global\n    option httplog\n")
    conf = work / "haproxy.cfg"
    conf.write_text(text)
    return conf


@dataclass
class HAProxy:
    """A running haproxy and its admin socket."""

    proc: subprocess.Popen[bytes]
    port: int
    admin_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, line: str) -> str:
        """One command on the admin socket (HAProxy closes it after the answer)."""
        with socket.create_connection(("127.0.0.1", self.admin_port), timeout=5) as sock:
            sock.sendall(line.encode() + b"\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        return answer.decode()

    def servers(self) -> dict[str, dict[str, str]]:
        """`show stat` for the backend: server name → its row (status, check_status, wredis, ...)."""
        lines = self.command("show stat").splitlines()
        names = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(names, line.split(","), strict=False)) for line in lines[1:] if line]
        return {row["svname"]: row for row in rows if row["pxname"] == "blazar"}

    def wait_status(self, server: str, status: str, timeout_s: float) -> dict[str, str]:
        """Wait until HAProxy reports ``server`` in ``status`` (UP, DOWN); return its row."""

        def row() -> dict[str, str] | None:
            current = self.servers()[server]
            return current if current["status"] == status else None

        return wait_until(
            row,
            f"HAProxy reports {server} {status}; log: {self.log()[-2000:]}",
            timeout_s=timeout_s,
            interval_s=0.1,
        )

    def redispatched(self, server: str) -> int:
        """How many requests HAProxy took away from ``server`` to send them to another."""
        return int(self.servers()[server]["wredis"] or 0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Pair:
    """HAProxy in front of two gateways, gw1 and gw2."""

    haproxy: HAProxy
    gateways: list[Running]
    ports: list[int]
    fake: FakeEngine


@pytest.fixture
def pair(tmp_path: Path, start_gateway: StartGateway, fake: FakeEngine) -> Iterator[Pair]:
    """Two gateways, then HAProxy in front of them; yields once HAProxy's checks have both UP."""
    binary = haproxy_binary()
    if binary is None:
        pytest.skip("haproxy is not installed; scripts/test installs it")
    listen, ports, admin_port = free_port(), [free_port(), free_port()], free_port()
    # A long drain: the tests end a gateway's drain themselves.
    gateways = start_pair(start_gateway, fake, ports, drain_timeout_s=30)
    conf = render_haproxy(tmp_path, listen, ports, admin_port)
    log_path = tmp_path / "haproxy.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([binary, "-db", "-f", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    haproxy = HAProxy(proc, listen, admin_port, log_path)
    try:
        wait_listening(listen)
        wait_listening(admin_port)
        for server in ("gw1", "gw2"):
            haproxy.wait_status(server, "UP", 10)
        yield Pair(haproxy, gateways, ports, fake)
    finally:
        proc.terminate()
        proc.wait(5)


def check_response(response: httpx.Response, stream: bool, request_id: str) -> str | None:
    """None when the response is whole and right, else what is wrong with it."""
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:300]}"
    if response.headers.get("x-request-id") != request_id:
        return f"x-request-id {response.headers.get('x-request-id')!r}, sent {request_id!r}"
    if not stream:
        text = response.json()["choices"][0]["message"]["content"]
        return None if text == EXPECTED_TEXT else f"text {text!r}"
    events = [e for e in response.content.split(b"\n\n") if e.strip()]
    if events[-1:] != [b"data: [DONE]"]:
        return f"stream does not end with [DONE]: {response.content[-300:]!r}"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return f"error event in the stream: {response.content[-300:]!r}"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    # Every token event, then the finish event.
    if len(chunks) != STREAM_CHUNKS + 1 or text != EXPECTED_TEXT:
        return f"{len(chunks)} events, text {text!r}"
    return None


def send(client: httpx.Client, url: str, stream: bool, request_id: str) -> str | None:
    """One chat request; None when its response is whole and right, else the problem."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    headers = {"x-fake": STREAM_FAKE if stream else TEXT_FAKE, "x-request-id": request_id}
    try:
        response = client.post(url + CHAT, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return f"transport error: {exc!r}"
    return check_response(response, stream, request_id)


def send_fresh(url: str, request_id: str, stream: bool) -> str | None:
    """One request on a new connection; None when its response is whole and right."""
    with httpx.Client(trust_env=False, timeout=30) as client:
        return send(client, url, stream, request_id)


def send_late_body(url: str, request_id: str, stream: bool) -> str | None:
    """A request whose body follows its head 0.3 s later; None when the response is whole and right."""
    body = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-request-id: {request_id}\r\n"
        f"x-fake: {STREAM_FAKE if stream else TEXT_FAKE}\r\n\r\n"
    )
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        time.sleep(0.3)  # the slow client itself, not a wait for a condition
        sock.sendall(body)
        raw = HTTPResponse(sock)
        raw.begin()
        response = httpx.Response(raw.status, headers=raw.getheaders(), content=raw.read())
    return check_response(response, stream, request_id)


def send_until_redispatched(
    haproxy: HAProxy, server: str, prefix: str, sender: Callable[[str, str, bool], str | None]
) -> set[str]:
    """Send requests through HAProxy until one sent to ``server`` is sent on to another.

    Each must succeed; returns their request ids.
    """
    before = haproxy.redispatched(server)
    ids: set[str] = set()

    def one_more() -> bool:
        request_id = f"{prefix}-{len(ids)}"
        ids.add(request_id)
        problem = sender(haproxy.url, request_id, len(ids) % 2 == 0)
        assert problem is None, f"{request_id}: {problem}"
        return haproxy.redispatched(server) > before

    wait_until(
        one_more, f"a request HAProxy sends to {server} is retried elsewhere", timeout_s=20, interval_s=0
    )
    return ids


@dataclass
class Outcome:
    request_id: str
    stream: bool
    started: float
    ended: float
    problem: str | None


@dataclass
class Load:
    """Clients that send requests back to back through HAProxy until stopped, keeping every outcome."""

    url: str
    workers: int
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for worker in range(self.workers):
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Let each client finish the request it has started, then stop it."""
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
            assert not thread.is_alive(), "a load client did not finish its last request within 60 s"

    def ok_after(self, moment: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.started > moment and o.problem is None)

    def _run(self, worker: int) -> None:
        with httpx.Client(trust_env=False, timeout=60) as client:
            number = 0
            while not self._stop.is_set():
                number += 1
                # Two streams for each non-streamed request.
                stream = (worker + number) % 3 != 0
                request_id = f"load-{worker}-{number}"
                started = time.monotonic()
                problem = send(client, self.url, stream, request_id)
                self.outcomes.append(Outcome(request_id, stream, started, time.monotonic(), problem))


def test_shipped_haproxy_cfg_passes_haproxys_own_check() -> None:
    """`haproxy -c` accepts deploy/haproxy.cfg as shipped, without a warning."""
    binary = haproxy_binary()
    if binary is None:
        pytest.skip("haproxy is not installed; scripts/test installs it")
    result = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output and "ALERT" not in output, output


def test_load_spreads_and_streams_pass_event_by_event(pair: Pair, http: httpx.Client) -> None:
    """Concurrent streams are spread over both gateways, and each event passes HAProxy as it is made."""
    url = pair.haproxy.url
    with concurrent.futures.ThreadPoolExecutor(6) as pool:

        def one(i: int) -> str | None:
            with httpx.Client(trust_env=False, timeout=30) as client:
                return send(client, url, True, f"spread-{i}")

        problems = list(pool.map(one, range(6)))
    assert problems == [None] * 6
    assert all(counted(gateway, http) > 0 for gateway in pair.gateways)

    # Not buffered anywhere: the first event reaches the client while the
    # engine is still writing the stream (it records when it finished).
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"x-fake": "chunks=10; chunk-delay=0.3", "x-request-id": "event-by-event"}
    with (
        httpx.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", url + CHAT, json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        record = pair.fake.wait_for_record(lambda r: r["headers"].get("x-request-id") == "event-by-event")
        assert record["finished_at"] is None and record["events_sent"] < 11, record
        rest = [line for line in events if line.startswith("data: ")]
    assert "tok0" in first and rest[-1] == "data: [DONE]"

    # A prompt larger than HAProxy's buffer passes too (streamed on; see haproxy.cfg).
    big = {"model": "fake", "messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 3}
    response = http.post(url + CHAT, json=big)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]


@pytest.mark.fault("balancers", "HAProxy in front")
def test_a_draining_gateways_503_is_retried_and_its_check_takes_it_out(
    pair: Pair, http: httpx.Client
) -> None:
    """Checks paused, a draining gateway's 503s are retried on the other; resumed, its check takes it out."""
    haproxy, (gw1, gw2) = pair.haproxy, pair.gateways
    haproxy.command("disable health blazar/gw1")
    # A stream sent to gw1 directly holds it in its drain; HAProxy does not count it.
    holder = httpx.Client(trust_env=False, timeout=30)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    request = holder.build_request(
        "POST", gw1.url + CHAT, json=body, headers={"x-fake": "chunks=600; chunk-delay=0.1"}
    )
    held = holder.send(request, stream=True)
    try:
        assert held.status_code == 200
        wait_until(lambda: in_flight(gw1, http) == 1, "gw1 serves the holding stream", timeout_s=10)
        gw1.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http.get(gw1.url + "/readyz").status_code == 503, "gw1 drains", timeout_s=10)

        # HAProxy still has gw1 in the rotation: what it sends there comes back
        # 503 `draining` and is sent again to gw2.
        retried = send_until_redispatched(haproxy, "gw1", "retry", send_fresh)
        # A body that follows its head later (a slow client, Expect: 100-continue)
        # is retried too: HAProxy waits for it (option http-buffer-request).
        retried |= send_until_redispatched(haproxy, "gw1", "late-body", send_late_body)
        assert haproxy.servers()["gw1"]["status"] != "DOWN"
        wait_until(lambda: retried <= served_ids(gw2), "gw2 logged the retried requests", timeout_s=10)

        # With its checks back, HAProxy sees /readyz 503 and takes gw1 out.
        haproxy.command("enable health blazar/gw1")
        row = haproxy.wait_status("gw1", "DOWN", 10)
        assert row["check_code"] == "503", row
        before = haproxy.redispatched("gw1")
        for n in range(4):
            assert send_fresh(haproxy.url, f"after-down-{n}", stream=bool(n % 2)) is None
        assert haproxy.redispatched("gw1") == before
    finally:
        held.close()
        holder.close()
    # Its last client gone, gw1 ends its drain and exits cleanly.
    assert gw1.proc.wait(15) == 0


@pytest.mark.fault("balancers", "HAProxy in front")
def test_a_gateway_that_died_is_retried_on_the_other(pair: Pair) -> None:
    """Checks paused, a killed gateway's refused connections are retried on the other; resumed, it is out."""
    haproxy, (gw1, gw2) = pair.haproxy, pair.gateways
    haproxy.command("disable health blazar/gw1")
    gw1.proc.kill()
    gw1.proc.wait(10)
    retried = send_until_redispatched(haproxy, "gw1", "refused", send_fresh)
    wait_until(lambda: retried <= served_ids(gw2), "gw2 logged the retried requests", timeout_s=10)
    haproxy.command("enable health blazar/gw1")
    row = haproxy.wait_status("gw1", "DOWN", 10)
    assert row["check_status"] == "L4CON", row


@pytest.mark.fault("balancers", "HAProxy in front")
@pytest.mark.timeout(150)
def test_sigterm_under_load_loses_nothing_and_the_gateway_rejoins(
    pair: Pair, start_gateway: StartGateway, http: httpx.Client
) -> None:
    """SIGTERM a gateway under load: its streams finish, traffic moves, none fails; restarted, it rejoins."""
    haproxy, (gw1, gw2), fake = pair.haproxy, pair.gateways, pair.fake
    load = Load(haproxy.url, workers=6)
    load.start()
    try:
        wait_until(lambda: in_flight(gw1, http) >= 2, "gw1 has requests in flight", timeout_s=20)
        wait_until(lambda: counted(gw2, http) > 0, "gw2 serves too", timeout_s=20)
        signalled = time.monotonic()
        gw1.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http.get(gw1.url + "/readyz").status_code == 503, "gw1 drains", timeout_s=10)
        draining = time.monotonic()
        haproxy.wait_status("gw1", "DOWN", 15)
        assert gw1.proc.wait(30) == 0
        exited = time.monotonic()
        old_gw1_served = served_ids(gw1)
        wait_until(lambda: load.ok_after(exited) >= 5, "requests succeed with gw1 gone", timeout_s=20)

        # Back on its port, it passes HAProxy's checks and gets traffic again.
        again = start_gateway({"fake": fake.url}, "--drain-timeout", "10", "--port", str(pair.ports[0]))
        haproxy.wait_status("gw1", "UP", 20)
        wait_until(lambda: counted(again, http) > 0, "the restarted gw1 serves requests", timeout_s=20)
    finally:
        load.stop()

    outcomes = load.outcomes
    problems = [o for o in outcomes if o.problem is not None]
    assert not problems, f"{len(problems)} of {len(outcomes)} requests failed: {problems[:5]}"
    ids = {o.request_id for o in outcomes}
    assert len(ids) == len(outcomes) >= 20
    # gw1's streams in flight at SIGTERM finished there, whole, with [DONE].
    finished_there = [
        o for o in outcomes if o.request_id in old_gw1_served and o.started < signalled < o.ended
    ]
    assert any(o.stream for o in finished_there), finished_there
    # Nothing that began once gw1 was draining was served by it; gw2 took it all until gw1 came back.
    after_drain = {o.request_id for o in outcomes if o.started > draining and o.ended < exited}
    assert not after_drain & old_gw1_served
    # Every request is in exactly one gateway's access log (a line is written
    # just after the response's last byte, so give the last ones a moment).
    wait_until(
        lambda: ids <= old_gw1_served | served_ids(gw2) | served_ids(again),
        "every request is logged",
        timeout_s=10,
    )
    assert after_drain <= served_ids(gw2)
    assert not old_gw1_served & served_ids(gw2)
