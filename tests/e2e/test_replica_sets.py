"""One model served by a set of servers: spread, affinity, ejection, rejoining, nothing sent twice.

Two fake engines (real sockets) behind one gateway as ``--upstream m=A
--upstream m=B``; what each fake was sent is read from its own records.
The real engines as two children of one model: affinity on mlx's prompt
cache, and who watches the children (their own logs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway
from tests.e2e.test_config import hang_up, write_config
from tests.e2e.test_engine_llamacpp import ENGINE as LLAMACPP
from tests.e2e.test_engine_llamacpp import engine_python as engine_python
from tests.e2e.test_engine_mlx import ENGINE
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.e2e.test_engine_models import _READY_TIMEOUT_S, ConfigGateway, _model_table
from tests.helpers import engine_home, free_port, wait_until

CHAT = "/v1/chat/completions"
# Active checks this often, so that a stopped and restarted fake rejoins quickly.
INTERVAL = "0.3"


def _chat(system: str, turns: int) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"answer {turn}"})
        messages.append({"role": "user", "content": f"question {turn} of {system[:20]}"})
    return {"model": "m", "messages": messages, "max_tokens": 4}


def _sent(fake: FakeEngine) -> list[dict[str, Any]]:
    """The completions the fake was sent (its checks left out)."""
    return [r for r in fake.records() if r["path"].endswith("/completions")]


def _systems(fake: FakeEngine) -> list[str]:
    return [orjson.loads(r["body"])["messages"][0]["content"] for r in _sent(fake)]


def _metric(text: str, name: str, replica_port: int) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f":{replica_port}/v1" in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for port {replica_port} in:\n{text}")


def _set_gateway(start_gateway: StartGateway, a: FakeEngine, b: FakeEngine, *args: str) -> Running:
    return start_gateway({"m": a.url}, "--upstream", f"m={b.url}", "--health-interval", INTERVAL, *args)


def _set(start_gateway: StartGateway, a: FakeEngine, b: FakeEngine, *args: str) -> httpx.Client:
    gw = _set_gateway(start_gateway, a, b, *args)
    return httpx.Client(base_url=gw.url, trust_env=False, timeout=10)


def _access_lines(gw: Running, count: int) -> list[str]:
    """The gateway's text access-log lines of completions, once there are ``count`` of them."""

    def found() -> list[str]:
        return [line for line in gw.log().splitlines() if f'"POST {CHAT}"' in line]

    wait_until(lambda: len(found()) >= count, f"{count} access-log lines")
    return found()


def test_set_is_listed_once_and_spreads_conversations(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """/v1/models lists a replica set once; new conversations go to both servers, each sent once."""
    a, b = start_fake_engine(), start_fake_engine()
    with _set(start_gateway, a, b) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["m"]
        for index in range(10):
            response = client.post(CHAT, json=_chat(f"system prompt number {index} " * 20, 1))
            assert response.status_code == 200, response.text
    on_a, on_b = len(_sent(a)), len(_sent(b))
    assert on_a + on_b == 10  # nothing sent twice
    assert on_a >= 3 and on_b >= 3, (on_a, on_b)


def test_a_list_of_urls_in_the_config_file_is_one_set(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, tmp_path: Path
) -> None:
    """upstream = [A, B] in a model's table: one model, both servers sent requests."""
    a, b = start_fake_engine(), start_fake_engine()
    config = tmp_path / "blazar.toml"
    config.write_text(f'[models.m]\nupstream = ["{a.url}/v1", "{b.url}"]\n')
    gw = start_gateway({}, "--config", str(config), "--affinity-slack", "off")
    with httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]
        for index in range(4):
            assert client.post(CHAT, json=_chat(f"file {index}", 1)).status_code == 200
    assert (len(_sent(a)), len(_sent(b))) == (2, 2)


def test_turns_of_a_conversation_stay_on_one_replica(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """With affinity, every turn of a conversation goes to the server that served its first turn."""
    a, b = start_fake_engine(), start_fake_engine()
    systems = [f"you are assistant {index}; " * 40 for index in range(4)]
    with _set(start_gateway, a, b) as client:
        for turns in (1, 2, 3):
            for system in systems:
                response = client.post(CHAT, json=_chat(system, turns))
                assert response.status_code == 200, response.text
        metrics = client.get("/metrics").text
    on_a, on_b = _systems(a), _systems(b)
    assert len(on_a) + len(on_b) == 12
    for system in systems:
        # All three turns on one side, none on the other.
        assert sorted((on_a.count(system), on_b.count(system))) == [0, 3], system[:30]
    hits = _metric(metrics, "blazar_replica_affinity_hits_total", a.port)
    hits += _metric(metrics, "blazar_replica_affinity_hits_total", b.port)
    assert hits == 8  # turns 2 and 3 of each conversation


def test_affinity_off_is_least_busy(start_fake_engine: StartFakeEngine, start_gateway: StartGateway) -> None:
    """--affinity-slack off: one conversation's turns alternate, as plain least-busy sends them."""
    a, b = start_fake_engine(), start_fake_engine()
    with _set(start_gateway, a, b, "--affinity-slack", "off") as client:
        for turns in (1, 2, 3, 4):
            assert client.post(CHAT, json=_chat("one conversation " * 40, turns)).status_code == 200
    assert (len(_sent(a)), len(_sent(b))) == (2, 2)


@pytest.mark.fault("fleet", "a server of a set that dies and comes back")
def test_dead_replica_costs_no_request_and_rejoins(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """A stopped server is ejected and costs no request; started again on its port, it gets traffic."""
    a, b = start_fake_engine(), start_fake_engine()
    port = b.port
    gw = _set_gateway(start_gateway, a, b, "--affinity-slack", "off")
    with httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as client:
        assert client.post(CHAT, json=_chat("warm up", 1)).status_code == 200
        before_a, before_b = len(_sent(a)), len(_sent(b))
        assert before_a + before_b == 1
        b.stop()
        for index in range(10):
            response = client.post(CHAT, json=_chat(f"while b is down {index}", 1))
            assert response.status_code == 200, response.text
        metrics = client.get("/metrics").text
        assert _metric(metrics, "blazar_replica_ejections_total", port) >= 1
        assert _metric(metrics, "blazar_replica_ejections_total", a.port) == 0
        assert client.get("/readyz").status_code == 200  # one server of the set serves
        # Everything since b stopped went to a, once each: nothing was sent twice.
        assert len(_sent(a)) == before_a + 10
        assert len([s for s in _systems(a) if s.startswith("while b is down")]) == 10
        # A request that moved says so in its access-log line, as nginx's $upstream_addr: b, then a.
        lines = _access_lines(gw, 11)
        moved = [line for line in lines if " upstream=" in line]
        assert moved, lines
        assert all(line.endswith(f" upstream=127.0.0.1:{port},127.0.0.1:{a.port}") for line in moved), moved
        assert all(" 200 " in line for line in moved), moved
        assert _metric(metrics, "blazar_replica_moved_away_total", port) == len(moved)
        assert _metric(metrics, "blazar_replica_moved_away_total", a.port) == 0

        again = start_fake_engine("--port", str(port))
        deadline = time.monotonic() + 10 * float(INTERVAL) + 5
        while not _sent(again):
            assert time.monotonic() < deadline, "the restarted server got no request"
            assert client.post(CHAT, json=_chat("after b is back", 1)).status_code == 200
            time.sleep(0.1)


def _probes(fake: FakeEngine) -> list[dict[str, Any]]:
    """The test requests the gateway itself sent the fake (a replica's probe)."""
    return [r for r in _sent(fake) if r["headers"].get("user-agent") == "blazar-proxy replica probe"]


@pytest.mark.fault("fleet", "a server of a set that answers 5xx")
def test_a_replica_that_fails_its_own_test_request_is_ejected(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """A server that answers 500 to everything fails the gateway's own test request after its first
    500 and is ejected; each 500 reaches its client as it is, and passing checks of its /health do
    not bring it back."""
    a, b = start_fake_engine(), start_fake_engine("--status", "500")
    with _set(start_gateway, a, b, "--affinity-slack", "off") as client:
        statuses = [client.post(CHAT, json=_chat(f"q {index}", 1)).status_code for index in range(12)]
        time.sleep(3 * float(INTERVAL))  # several passed checks of b's /health
        statuses += [client.post(CHAT, json=_chat(f"r {index}", 1)).status_code for index in range(4)]
        metrics = client.get("/metrics").text
    failed = statuses.count(500)
    assert 1 <= failed <= 3 and statuses.count(200) == 16 - failed, statuses
    assert statuses[-4:] == [200] * 4
    assert len(_probes(b)) == 1 and _probes(a) == []
    assert len(_sent(b)) == failed + 1 and len(_sent(a)) == 16 - failed
    assert _metric(metrics, "blazar_replica_ejections_total", b.port) == 1


@pytest.mark.fault("fleet", "requests whose own content fails on every server")
def test_no_client_can_eject_a_healthy_replica_by_its_own_bad_requests(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """One client's requests that each server closes without a reply (x-fake: empty, as mlx does on a
    field it cannot take) get their 502s, but eject no replica: another client is served throughout."""
    a, b = start_fake_engine(), start_fake_engine()
    gw = _set_gateway(start_gateway, a, b)
    with (
        httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as hostile,
        httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as other,
    ):
        for round_ in range(4):
            for _ in range(6):
                response = hostile.post(CHAT, json=_chat(f"bad {round_}", 1), headers={"x-fake": "empty"})
                assert response.status_code == 502, response.text
                assert response.json()["error"]["code"] == "upstream_empty_reply"
            for index in range(2):
                response = other.post(CHAT, json=_chat(f"good {round_} {index}", 1))
                assert response.status_code == 200, response.text
        metrics = other.get("/metrics").text
    assert _metric(metrics, "blazar_replica_ejections_total", a.port) == 0
    assert _metric(metrics, "blazar_replica_ejections_total", b.port) == 0
    # Each server that failed a request was sent the gateway's own test request, and passed it;
    # 24 bad requests cost each server a probe or two, not one each.
    probed = _probes(a) + _probes(b)
    assert 1 <= len(probed) <= 4, probed
    assert all(orjson.loads(r["body"])["max_tokens"] == 1 for r in probed)
    assert "out of rotation" not in gw.log()


@pytest.mark.fault("fleet", "a set with every server out")
def test_every_replica_out_is_503_with_retry_after(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """With both servers stopped the model answers 503 with Retry-After in OpenAI's envelope, at once."""
    a, b = start_fake_engine(), start_fake_engine()
    with _set(start_gateway, a, b) as client:
        a.stop()
        b.stop()
        for _ in range(3):
            response = client.post(CHAT, json=_chat("nobody home", 1))
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"]
            error = response.json()["error"]
            assert error["message"] and error["code"] in ("no_healthy_replica", "upstream_unavailable")
        # /readyz follows at the next timed check of the upstreams.
        wait_until(lambda: client.get("/readyz").status_code == 503, "/readyz says the set is out")
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["models"] == {"m": "unreachable"}


def _engine_pair(tmp_path: Path, model: str, engine: str, *args: str) -> ConfigGateway:
    """A gateway whose model ``model`` is two children of ``engine`` serving builtin:tiny, both ready."""
    table = _model_table(model, "builtin:tiny", engine, replicas=2, always_loaded=True)
    gateway = ConfigGateway(table, tmp_path, *args)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not all(gateway.metric("blazar_engine_child_ready", model=model, replica=str(i)) for i in (0, 1)):
        if time.monotonic() > deadline:
            gateway.stop()
            raise AssertionError(gateway.log())
        time.sleep(0.1)
    return gateway


class ChildLog:
    """What one child of a model logs from now on (its log file is appended to across runs)."""

    def __init__(self, engine: str, model: str, replica: int) -> None:
        self.path = engine_home() / "logs" / f"{engine}--{model}-{replica}.log"
        self.start = self.path.stat().st_size if self.path.exists() else 0

    def gets(self, path: str) -> int:
        """The GETs of ``path`` it logged (mlx_lm.server's and uvicorn's request lines)."""
        with self.path.open("rb") as log:
            log.seek(self.start)
            text = log.read().decode(errors="replace")
        return len(re.findall(rf'"GET {re.escape(path)} HTTP/1\.[01]"', text))


def _child_logs(engine: str, model: str) -> list[ChildLog]:
    return [ChildLog(engine, model, replica) for replica in (0, 1)]


@pytest.fixture
def mlx_pair(engine_installed: None, tmp_path: Path) -> Iterator[ConfigGateway]:
    """The real mlx engine, two replicas of builtin:tiny, both ready; affinity at its default."""
    gateway = _engine_pair(tmp_path, "pair", ENGINE)
    try:
        yield gateway
    finally:
        gateway.stop()


def test_mlx_children_of_a_set_are_watched_by_their_manager_only(
    engine_installed: None, tmp_path: Path
) -> None:
    """Two mlx children, active checks every 0.2 s: each child's log shows only its manager's GET
    /health (every 5 s), never the checker's /readyz, and both serve."""
    logs = _child_logs(ENGINE, "watched")
    gateway = _engine_pair(tmp_path, "watched", ENGINE, "--health-interval", "0.2")
    try:
        seen = [log.gets("/health") for log in logs]
        # Two more polls by the manager: 5 s or more, some 25 rounds of the gateway's checks.
        wait_until(
            lambda: all(log.gets("/health") >= n + 2 for log, n in zip(logs, seen, strict=True)),
            "two more health polls by the manager",
            timeout_s=60,
        )
        assert [log.gets("/readyz") for log in logs] == [0, 0]
        for turn in range(4):
            response = gateway.http.post(CHAT, json={**_chat(f"watched {turn}", 1), "model": "watched"})
            assert response.status_code == 200, response.text
    finally:
        gateway.stop()


@pytest.mark.llamacpp
def test_llamacpp_children_of_a_set_stay_in_rotation(engine_python: Path, tmp_path: Path) -> None:
    """Two llama-server children, checked by the gateway every 0.2 s, stay in rotation (none ejected);
    eight requests at once are spread over both (each child's own token counter, scraped through
    /admin/models/NAME/metrics with its replica label, moves), and every one is answered."""
    gateway = _engine_pair(tmp_path, "lcpair", LLAMACPP, "--health-interval", "0.2")
    try:
        time.sleep(2.0)  # ten rounds of the gateway's checks
        scrape = "/admin/models/lcpair/metrics"
        before = gateway.http.get(scrape).text
        with ThreadPoolExecutor(8) as pool:
            replies = list(
                pool.map(
                    lambda turn: gateway.http.post(
                        CHAT, json={**_chat(f"llama {turn}", 1), "model": "lcpair", "max_tokens": 48}
                    ),
                    range(8),
                )
            )
        assert [reply.status_code for reply in replies] == [200] * 8, [reply.text for reply in replies]
        after = gateway.http.get(scrape).text
        for replica in ("0", "1"):
            sample = f'llamacpp:n_decode_total{{model="lcpair",replica="{replica}"}} '
            counts = [
                float(line.rsplit(" ", 1)[1])
                for text in (before, after)
                for line in text.splitlines()
                if line.startswith(sample)
            ]
            assert len(counts) == 2 and counts[1] > counts[0], (replica, before, after)
        metrics = gateway.http.get("/metrics").text
        ejections = [
            line for line in metrics.splitlines() if line.startswith("blazar_replica_ejections_total{")
        ]
        assert len(ejections) == 2 and all(line.endswith(" 0.0") for line in ejections), ejections
    finally:
        gateway.stop()


def _second_turn_is_cached(http: httpx.Client, model: str) -> None:
    """Turn 2 of a conversation with a ~1,000-token system prompt is served from turn 1's prompt cache.

    Plain least-busy would send turn 2 to the other replica (fewer served): an empty cache there.
    """
    # builtin:tiny's tokenizers make about a token of a character.
    system = "".join(f"rule {index}: answer briefly. " for index in range(45))[:1000]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "first question"},
    ]
    body = {"model": model, "max_tokens": 2, "temperature": 0}
    first = http.post(CHAT, json={**body, "messages": messages})
    assert first.status_code == 200, first.text
    first_prompt = first.json()["usage"]["prompt_tokens"]
    assert first_prompt >= 900
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "second question"},
    ]
    second = http.post(CHAT, json={**body, "messages": messages})
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * first_prompt, usage
    assert cached < usage["prompt_tokens"]


@pytest.mark.llamacpp
def test_llamacpp_second_turn_is_served_from_its_prompt_cache(engine_python: Path, tmp_path: Path) -> None:
    """Two llama-server replicas: turn 2 of a conversation goes where turn 1 went, and that child
    reports nearly all of turn 1's prompt as cached_tokens: each slot keeps its prompt."""
    gateway = _engine_pair(tmp_path, "lcaff", LLAMACPP)
    try:
        _second_turn_is_cached(gateway.http, "lcaff")
    finally:
        gateway.stop()


def test_mlx_second_turn_is_served_from_its_prompt_cache(mlx_pair: ConfigGateway) -> None:
    """Two mlx replicas: turn 2 of a conversation with a ~1,000-token system prompt goes where turn 1
    went, and the engine reports nearly all of turn 1's prompt as cached_tokens."""
    _second_turn_is_cached(mlx_pair.http, "pair")


@pytest.mark.fault("fleet", "requests whose own content fails on every server")
def test_mlx_no_client_can_eject_a_healthy_replica(mlx_pair: ConfigGateway) -> None:
    """Two mlx replicas: one client's requests with fields mlx_lm.server drops the socket on
    (xtc_probability 0, and the other wrong types the hardening issue listed) get 400s naming the
    field, and another client is still served by both replicas: none left rotation.

    Before, each of these was a 502 upstream_empty_reply, three in a row ejected a replica, and
    the other client got 503 no_healthy_replica. A content-caused 5xx that passes the field checks
    (none is known on mlx) is covered by the fake engine's test above: it only makes the replica
    suspect, and the gateway's own test request decides.
    """
    hostile = [
        ("xtc_probability", 0),
        ("xtc_threshold", 0),
        ("repetition_context_size", -1),
        ("num_draft_tokens", "x"),
        ("adapters", 5),
    ]
    answers: list[str] = []
    for round_ in range(2):
        for field, value in hostile:
            bad = {**_chat("hostile", 1), "model": "pair", field: value}
            response = mlx_pair.http.post(CHAT, json=bad)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == field, response.text
        for index in range(2):
            good = {**_chat(f"served {round_} {index}", 1), "model": "pair"}
            response = mlx_pair.http.post(CHAT, json=good)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["message"]["content"])
    assert all(answers), answers
    metrics = mlx_pair.http.get("/metrics").text
    ejections = [line for line in metrics.splitlines() if line.startswith("blazar_replica_ejections_total{")]
    assert len(ejections) == 2 and all(line.endswith(" 0.0") for line in ejections), ejections
    assert "out of rotation" not in mlx_pair.log()


def _checks(fake: FakeEngine) -> int:
    """The health checks the fake was asked (GET /readyz, then /health)."""
    return len([r for r in fake.records() if r["method"] == "GET" and r["path"] in ("/readyz", "/health")])


@pytest.mark.fault("fleet", "a server of a set that dies and comes back")
def test_a_reload_that_rebuilds_a_set_checks_its_new_servers_only(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, tmp_path: Path
) -> None:
    """After a reload from [a, b] to [a, dead, c]: the active checks take the dead new server out
    before any request finds it, b (removed) is checked no more, c gets requests, none is lost."""
    a, b, c = start_fake_engine(), start_fake_engine(), start_fake_engine()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path = tmp_path / "blazar.toml"
    write_config(path, f'[models.m]\nupstream = ["{a.url}", "{b.url}"]\n')
    gw = start_gateway({}, "--config", str(path), "--health-interval", INTERVAL, "--affinity-slack", "off")
    wait_until(lambda: _checks(b) >= 2, "b is checked before the reload")

    write_config(path, f'[models.m]\nupstream = ["{a.url}", "{dead}", "{c.url}"]\n')
    assert hang_up(gw).split("reload: ", 1)[1] == "updated m (static upstream)"
    # No request yet: only an active check of the new server can take it out.
    # The line says why (the check's own cause), not only that checks failed.
    out = f"{dead}/v1 is out of rotation: 2 failed checks of /readyz (connection refused)"
    wait_until(lambda: out in gw.log(), "the dead server is out")
    after = _checks(b)
    # Several more rounds of checks of the set: c's count says they ran.
    seen = _checks(c)
    wait_until(lambda: _checks(c) >= seen + 3, "three more checks of c")
    assert _checks(b) == after, "a removed server is still checked"
    assert _sent(b) == []

    with httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as client:
        for index in range(6):
            response = client.post(CHAT, json=_chat(f"after the reload {index}", 1))
            assert response.status_code == 200, response.text
        metrics = client.get("/metrics").text
    # Nothing sent twice, nothing lost on the dead server; the live new one takes its share.
    assert (len(_sent(a)), len(_sent(c))) == (3, 3)
    dead_port = int(dead.rsplit(":", 1)[1])
    assert _metric(metrics, "blazar_replica_ejections_total", dead_port) == 1
    assert _metric(metrics, "blazar_replica_ejections_total", c.port) == 0
