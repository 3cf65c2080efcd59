"""--config FILE end to end: precedence, startup errors, aliases, reloads (SIGHUP and --watch-config)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import ROOT, FakeEngine, Running, StartFakeEngine, StartGateway
from tests.helpers import error_of, free_port, sse_events, wait_until

CHAT = "/v1/chat/completions"


def chat(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def model_table(name: str, fake: FakeEngine, *aliases: str) -> str:
    """One [models.NAME] table for a fake engine as a static upstream."""
    text = f'[models."{name}"]\nupstream = "{fake.url}/v1"\n'
    if aliases:
        text += f"aliases = {list(aliases)!r}\n".replace("'", '"')
    return text + "\n"


def write_config(path: Path, text: str) -> None:
    """Replace the file whole (write aside, then rename), as careful editors save."""
    aside = path.with_name(path.name + ".new")
    aside.write_text(text, encoding="utf-8")
    os.replace(aside, path)


def served_ids(gateway: Running, http: httpx.Client) -> list[str]:
    response = http.get(gateway.url + "/v1/models")
    assert response.status_code == 200
    return [m["id"] for m in response.json()["data"]]


def reload_outcomes(gateway: Running) -> list[str]:
    """The lines that end a reload: what changed, that nothing did, or why it failed."""
    return [
        line
        for line in gateway.log().splitlines()
        if line.startswith("blazar-proxy: reload")
        and not line.startswith("blazar-proxy: reload: reading")
        and not line.startswith("blazar-proxy: reload: [gateway]")
    ]


def hang_up(gateway: Running) -> str:
    """Send SIGHUP and return the line that reports how the reload ended."""
    before = len(reload_outcomes(gateway))
    gateway.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: len(reload_outcomes(gateway)) > before, "the reload ends")
    assert gateway.proc.poll() is None, gateway.log()
    return reload_outcomes(gateway)[-1]


def ask(gateway: Running, http: httpx.Client, model: str) -> httpx.Response:
    return http.post(gateway.url + CHAT, json=chat(model))


def models_seen(fake: FakeEngine) -> list[str | None]:
    return [r["model"] for r in fake.records()]


def stream_body(url: str, model: str, fake_header: str) -> bytes:
    body = chat(model, stream=True)
    with (
        httpx.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", url + CHAT, json=body, headers={"x-fake": fake_header}) as response,
    ):
        assert response.status_code == 200
        return response.read()


@pytest.fixture
def streams() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """Threads for client streams that run while the test reloads the gateway."""
    pool = concurrent.futures.ThreadPoolExecutor(4)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


def _gateway_env(extra: dict[str, str]) -> dict[str, str]:
    # Only the BLAZAR_* variables the test names: the precedence tests count on it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLAZAR_") or k.startswith("BLAZAR_TEST")}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra}


Launch = Callable[..., Running]


@pytest.fixture
def launch(logs_dir: Path) -> Iterator[Launch]:
    """Start a gateway with exactly the given arguments and variables, and wait for it on ``port``."""
    started: list[Running] = []

    def start(*args: str, port: int, env: dict[str, str] | None = None) -> Running:
        log_path = logs_dir / f"gateway-config-{port}-{time.monotonic_ns()}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "--log-level", "warning", *args],
                cwd=ROOT,
                env=_gateway_env(env or {}),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        gateway = Running(proc=proc, port=port, log_path=log_path)
        started.append(gateway)

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gateway exited with {proc.returncode}: {gateway.log()}")
            try:
                return httpx.get(f"{gateway.url}/livez", timeout=1, trust_env=False).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(listening, f"the gateway listens on {port}", timeout_s=15)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def run_to_exit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        env=_gateway_env(env or {}),
        capture_output=True,
        text=True,
        timeout=30,
    )


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/livez", timeout=1, trust_env=False)
    except httpx.ConnectError:
        return True
    return False


# -- precedence ----------------------------------------------------------------


def test_command_line_beats_environment_beats_file(
    launch: Launch, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """port and api-key: the file's value alone, BLAZAR_* over the file, the command line over both."""
    fake = start_fake_engine()
    file_port, env_port, cli_port = free_port(), free_port(), free_port()
    path = tmp_path / "blazar.toml"
    write_config(path, f'[gateway]\nport = {file_port}\napi-key = "file-key"\n\n' + model_table("a", fake))

    def key_works(gateway: Running, key: str) -> bool:
        response = http.get(gateway.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
        assert response.status_code in (200, 401), response.text
        return response.status_code == 200

    gateway = launch("--config", str(path), port=file_port)
    assert key_works(gateway, "file-key") and not key_works(gateway, "other")
    assert http.get(gateway.url + "/v1/models").status_code == 401
    gateway.stop()

    env = {"BLAZAR_PORT": str(env_port), "BLAZAR_API_KEY": "env-key"}
    gateway = launch("--config", str(path), port=env_port, env=env)
    assert refused(f"http://127.0.0.1:{file_port}")
    assert key_works(gateway, "env-key") and not key_works(gateway, "file-key")
    gateway.stop()

    gateway = launch(
        "--config", str(path), "--port", str(cli_port), "--api-key", "cli-key", port=cli_port, env=env
    )
    assert refused(f"http://127.0.0.1:{file_port}") and refused(f"http://127.0.0.1:{env_port}")
    assert key_works(gateway, "cli-key") and not key_works(gateway, "env-key")
    response = http.post(gateway.url + CHAT, json=chat("a"), headers={"authorization": "Bearer cli-key"})
    assert response.status_code == 200


def test_blazar_config_variable_names_the_file(
    launch: Launch, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """BLAZAR_CONFIG works like --config: the file's port and models are used."""
    fake = start_fake_engine()
    port = free_port()
    path = tmp_path / "blazar.toml"
    write_config(path, f"[gateway]\nport = {port}\n\n" + model_table("a", fake))
    gateway = launch(port=port, env={"BLAZAR_CONFIG": str(path)})
    assert served_ids(gateway, http) == ["a"]
    assert ask(gateway, http, "a").status_code == 200


# -- startup errors --------------------------------------------------------------


_UP = "http://127.0.0.1:9/v1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[models.a\nupstream = 1\n", ["not valid TOML"]),
        ("[gateway]\nprot = 8000\n", ["[gateway] prot: not a gateway setting", "did you mean 'port'?"]),
        ('[gateway]\nport = "abc"\n', ["[gateway] port:", "'abc'"]),
        ("[gateway]\nmax-in-flight = 0\n", ["[gateway] max-in-flight:", "0"]),
        (f'[models.a]\nupstreams = "{_UP}"\n', ["[models.a] upstreams: unknown key", "'upstream'"]),
        (
            f'[models.a]\nupstream = "{_UP}"\n\n[models.b]\nupstream = "https://127.0.0.1:9/v1"\n',
            ["[models.b] upstream:", "only http://"],
        ),
        (
            f'[models.a]\nupstream = "{_UP}"\n\n[models.b]\nupstream = "{_UP}"\nreplicas = 2\n',
            ["[models.b] replicas:"],
        ),
        (
            f'[models.a]\nupstream = "{_UP}"\naliases = ["x"]\n\n'
            f'[models.b]\nupstream = "{_UP}"\naliases = ["x"]\n',
            ["model name 'x' is used by both 'a' and 'b'"],
        ),
        ('[models.a]\nengine = "auto"\n', ["[models.a] engine:", "model is needed"]),
        ("[models.a]\nttl = 5\n", ["[models.a]: give engine (with model), or upstream"]),
    ],
)
def test_bad_file_at_startup_exits_before_listening(tmp_path: Path, text: str, expected: list[str]) -> None:
    """A bad file exits non-zero naming the file, the key and the reason; the server never starts."""
    path = tmp_path / "bad.toml"
    write_config(path, f"[gateway]\nlog-level = 'info'\n\n{text}" if "[gateway]" not in text else text)
    port = free_port()
    result = run_to_exit("--config", str(path), "--port", str(port))
    assert result.returncode != 0
    assert str(path) in result.stderr
    for part in expected:
        assert part in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "Started server process" not in result.stderr and "Uvicorn running" not in result.stderr
    assert refused(f"http://127.0.0.1:{port}")


def test_missing_file_at_startup_is_an_error(tmp_path: Path) -> None:
    """--config naming a file that does not exist exits non-zero, naming it."""
    path = tmp_path / "absent.toml"
    result = run_to_exit("--config", str(path))
    assert result.returncode != 0
    assert f"{path}: cannot read it" in result.stderr and "Traceback" not in result.stderr


def test_file_without_models_and_nothing_else_is_nothing_to_serve(tmp_path: Path) -> None:
    """A file with only [gateway] and no other model source is the usage error 'nothing to serve'."""
    path = tmp_path / "blazar.toml"
    write_config(path, "[gateway]\nport = 0\n")
    result = run_to_exit("--config", str(path))
    assert result.returncode == 2 and "nothing to serve" in result.stderr


def test_file_model_named_like_a_command_line_one_stops_the_start(
    tmp_path: Path, start_fake_engine: StartFakeEngine
) -> None:
    """A file model with the name (or alias) of an --upstream model: exit non-zero, naming the name."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    for text in (model_table("x", fake), model_table("y", fake, "x")):
        write_config(path, text)
        result = run_to_exit("--config", str(path), "--port", str(free_port()), "--upstream", f"x={fake.url}")
        assert result.returncode != 0
        assert "'x'" in result.stderr and "Traceback" not in result.stderr
        assert "Started server process" not in result.stderr


def test_startup_clash_with_the_command_line_names_the_file(
    tmp_path: Path, start_fake_engine: StartFakeEngine
) -> None:
    """The startup error for a file model clashing with an --upstream one names the file, as on reload."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("x", fake))
    result = run_to_exit("--config", str(path), "--port", str(free_port()), "--upstream", f"x={fake.url}")
    assert result.returncode != 0
    assert str(path) in result.stderr, result.stderr


def test_unknown_engine_at_startup_names_the_file_and_model(tmp_path: Path) -> None:
    """An engine version that does not exist exits non-zero naming the file, the model table and why."""
    path = tmp_path / "blazar.toml"
    write_config(path, '[models.a]\nengine = "nope-1.0"\n')
    result = run_to_exit("--config", str(path), env={"BLAZAR_HOME": str(tmp_path / "home")})
    assert result.returncode != 0
    assert f"{path}: [models.a]" in result.stderr and "unknown engine 'nope-1.0'" in result.stderr
    assert "Traceback" not in result.stderr


def test_auto_engine_with_an_unrecognised_model_is_a_config_error(tmp_path: Path) -> None:
    """engine = "auto" on a directory that holds no model exits non-zero naming the file and model table."""
    path = tmp_path / "blazar.toml"
    (tmp_path / "empty").mkdir()
    write_config(path, f'[models.a]\nengine = "auto"\nmodel = "{tmp_path / "empty"}"\n')
    result = run_to_exit("--config", str(path), env={"BLAZAR_HOME": str(tmp_path / "home")})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{path}: [models.a]" in result.stderr


@pytest.mark.parametrize("key", ["engine", "model", "served-name", "engine-variant"])
def test_model_option_in_gateway_table_is_refused(tmp_path: Path, key: str) -> None:
    """An option that names what to serve is refused in [gateway], pointing to [models.NAME] tables."""
    path = tmp_path / "blazar.toml"
    write_config(path, f'[gateway]\n{key} = "x"\n')
    result = run_to_exit("--config", str(path))
    assert result.returncode != 0
    assert f"[gateway] {key}: not a gateway setting" in result.stderr
    assert "[models.NAME]" in result.stderr, result.stderr


def test_upstream_in_gateway_table_points_to_models_tables(tmp_path: Path) -> None:
    """upstream in [gateway] is refused with the hint that models go in [models.NAME] tables."""
    path = tmp_path / "blazar.toml"
    write_config(path, '[gateway]\nupstream = "x=http://127.0.0.1:9"\n')
    result = run_to_exit("--config", str(path))
    assert result.returncode != 0
    assert "[gateway] upstream: not a gateway setting" in result.stderr
    assert "[models.NAME]" in result.stderr, result.stderr


# -- aliases -----------------------------------------------------------------------


def test_alias_is_forwarded_under_the_models_own_name(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A request for an alias reaches the engine with the model's own name and the rest of the body intact."""
    one, two = start_fake_engine(), start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("org/a", one, "gpt-4o-mini", "a-latest") + model_table("b", two))
    gateway = start_gateway({}, "--config", str(path))
    body = chat("gpt-4o-mini", temperature=0.5, user="u-1")
    response = http.post(gateway.url + CHAT, json=body)
    assert response.status_code == 200, response.text
    (record,) = one.records()
    assert record["model"] == "org/a"
    assert orjson.loads(record["body"]) == {**body, "model": "org/a"}
    raw = stream_body(gateway.url, "a-latest", "chunks=3")
    assert sse_events(raw)[-1] == b"data: [DONE]"
    assert models_seen(one) == ["org/a", "org/a"]
    completion = http.post(gateway.url + "/v1/completions", json={"model": "a-latest", "prompt": "x"})
    assert completion.status_code == 200 and models_seen(one)[-1] == "org/a"
    assert models_seen(two) == []


def test_models_list_shows_each_model_once_with_aliases_and_state(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """/v1/models lists each model once, with its aliases and state; GET /v1/models/ALIAS gives its entry."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("org/a", fake, "gpt-4o-mini", "a-latest") + model_table("b", fake))
    gateway = start_gateway({}, "--config", str(path))
    data = http.get(gateway.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["org/a", "b"]
    first, second = data
    assert first["aliases"] == ["gpt-4o-mini", "a-latest"]
    assert first["state"] == second["state"] == "loaded"
    assert first["object"] == "model"
    for name in ("gpt-4o-mini", "a-latest", "org/a"):
        entry = http.get(f"{gateway.url}/v1/models/{name}")
        assert entry.status_code == 200 and entry.json() == first, name
    missing = http.get(gateway.url + "/v1/models/gpt-5")
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"


# -- reloads -----------------------------------------------------------------------


def test_sighup_reload_changes_only_what_changed(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    streams: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """SIGHUP: unchanged models stream on uncut, changed ones move, new ones serve, removed ones are 404."""
    fakes = [start_fake_engine() for _ in range(4)]
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fakes[0]) + model_table("b", fakes[1]))
    gateway = start_gateway({}, "--config", str(path))
    stream = streams.submit(stream_body, gateway.url, "a", "chunks=40; chunk-delay=0.1")
    fakes[0].wait_for_record(lambda r: r["model"] == "a")

    write_config(path, model_table("a", fakes[0]) + model_table("b", fakes[2]) + model_table("c", fakes[3]))
    outcome = hang_up(gateway)
    assert outcome.split("reload: ", 1)[1] == "started c; updated b (static upstream)", outcome
    (in_flight,) = fakes[0].records()
    assert in_flight["finished_at"] is None, "the stream on a should span the reload"
    assert served_ids(gateway, http) == ["a", "b", "c"]
    assert ask(gateway, http, "b").status_code == 200
    assert ask(gateway, http, "c").status_code == 200
    assert models_seen(fakes[1]) == []
    assert models_seen(fakes[2]) == ["b"] and models_seen(fakes[3]) == ["c"]

    raw = stream.result(timeout=30)
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]" and b'"error"' not in raw
    assert len(events) == 40 + 2  # the tokens, the finish chunk, [DONE]
    fakes[0].wait_for_record(lambda r: r["outcome"] == "completed")

    write_config(path, model_table("a", fakes[0]) + model_table("b", fakes[2]))
    assert "removed c" in hang_up(gateway)
    gone = ask(gateway, http, "c")
    assert gone.status_code == 404 and error_of(gone)["code"] == "model_not_found"
    assert served_ids(gateway, http) == ["a", "b"]
    assert ask(gateway, http, "a").status_code == 200


def test_stream_on_a_model_whose_upstream_changes_completes(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    streams: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """A stream on a model moved to another upstream ends on the old one; new requests go to the new one."""
    old, new = start_fake_engine("--http11"), start_fake_engine("--http11")
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("b", old, "bee"))
    gateway = start_gateway({}, "--config", str(path))
    assert ask(gateway, http, "b").status_code == 200  # a pooled keep-alive connection to the old upstream
    stream = streams.submit(stream_body, gateway.url, "bee", "chunks=30; chunk-delay=0.1")
    old.wait_for_record(lambda r: r["stream"] is True)

    write_config(path, model_table("b", new, "bee"))
    assert "updated b (static upstream)" in hang_up(gateway)
    assert [r["finished_at"] for r in old.records() if r["stream"]] == [None]
    assert ask(gateway, http, "bee").status_code == 200
    assert models_seen(new) == ["b"]

    raw = stream.result(timeout=30)
    assert sse_events(raw)[-1] == b"data: [DONE]" and b'"error"' not in raw
    assert len(sse_events(raw)) == 30 + 2
    old.wait_for_record(lambda r: r["stream"] is True and r["outcome"] == "completed")
    # The old upstream gets nothing more once its last request is over.
    count = len(old.records())
    assert all(ask(gateway, http, "b").status_code == 200 for _ in range(3))
    assert len(old.records()) == count and models_seen(new) == ["b"] * 4


def test_stream_on_a_removed_model_completes(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    streams: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """A stream in flight on a model the reload removes runs to [DONE]; the next request for it is 404."""
    keep, gone = start_fake_engine(), start_fake_engine("--http11")
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", keep) + model_table("c", gone))
    gateway = start_gateway({}, "--config", str(path))
    stream = streams.submit(stream_body, gateway.url, "c", "chunks=30; chunk-delay=0.1")
    gone.wait_for_record(lambda r: r["model"] == "c")

    write_config(path, model_table("a", keep))
    assert "removed c" in hang_up(gateway)
    assert [r["finished_at"] for r in gone.records()] == [None]
    response = ask(gateway, http, "c")
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"

    raw = stream.result(timeout=30)
    assert sse_events(raw)[-1] == b"data: [DONE]" and b'"error"' not in raw
    assert len(sse_events(raw)) == 30 + 2
    gone.wait_for_record(lambda r: r["outcome"] == "completed")


def test_unchanged_model_keeps_its_slots_and_a_changed_limit_applies_to_them(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    streams: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """max-in-flight from the file: a model's request in flight still counts after a reload, whether
    the model is unchanged or only its limit changed (the new limit applies to the same slots)."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    head = "[gateway]\nmax-queued = 0\n\n"
    limited = model_table("a", fake) + "max-in-flight = 1\n\n"
    write_config(path, head + limited)
    gateway = start_gateway({}, "--config", str(path))
    stream = streams.submit(stream_body, gateway.url, "a", "chunks=40; chunk-delay=0.1")
    fake.wait_for_record(lambda r: r["stream"] is True)
    full = ask(gateway, http, "a")
    assert full.status_code == 429, full.text

    write_config(path, head + limited + model_table("b", fake))
    assert hang_up(gateway).split("reload: ", 1)[1] == "started b"
    assert ask(gateway, http, "a").status_code == 429  # the same slot is still taken
    assert ask(gateway, http, "b").status_code == 200

    write_config(path, head + model_table("a", fake) + "max-in-flight = 2\n\n" + model_table("b", fake))
    assert "updated a (static upstream)" in hang_up(gateway)
    assert _gauge(gateway, http, "blazar_requests_in_flight", "a") == 1  # the stream still counts
    assert ask(gateway, http, "a").status_code == 200  # the new limit of 2 lets one more in
    assert [r["finished_at"] for r in fake.records() if r["stream"]] == [None]
    raw = stream.result(timeout=30)
    assert sse_events(raw)[-1] == b"data: [DONE]" and b'"error"' not in raw


def _gauge(gateway: Running, http: httpx.Client, name: str, model: str) -> float:
    for line in http.get(gateway.url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model}")


def _ask_marked(url: str, model: str, mark: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": mark}], "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.post(url + CHAT, json=body).status_code


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_reload_changing_only_an_alias_keeps_the_models_queue(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    streams: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """max-in-flight 1, a stream running and two requests queued: a reload that adds an alias keeps
    them (/metrics: 1 in flight, 2 queued), and a request sent after it, by the alias, waits behind
    the two instead of running beside the stream."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake) + "max-in-flight = 1\n")
    gateway = start_gateway({}, "--config", str(path))
    stream = streams.submit(stream_body, gateway.url, "a", "chunks=30; chunk-delay=0.1")
    fake.wait_for_record(lambda r: r["stream"] is True)

    def queued_are(count: int) -> Callable[[], bool]:
        return lambda: _gauge(gateway, http, "blazar_queue_depth", "a") == count

    queued = []
    for index in range(2):
        queued.append(streams.submit(_ask_marked, gateway.url, "a", f"queued {index}"))
        wait_until(queued_are(index + 1), f"{index + 1} queued")

    write_config(path, model_table("a", fake, "alias") + "max-in-flight = 1\n")
    # Nothing restarts, and the reload says so (it said "restarted a").
    outcome = hang_up(gateway)
    assert outcome.split("reload: ", 1)[1] == "updated a (static upstream)", outcome
    assert _gauge(gateway, http, "blazar_requests_in_flight", "a") == 1
    assert _gauge(gateway, http, "blazar_queue_depth", "a") == 2
    after = streams.submit(_ask_marked, gateway.url, "alias", "after the reload")
    wait_until(queued_are(3), "the third queued")
    assert [r["stream"] for r in fake.records()] == [True]  # nothing overtook the stream

    assert [f.result(timeout=30) for f in (*queued, after)] == [200, 200, 200]
    raw = stream.result(timeout=30)
    assert sse_events(raw)[-1] == b"data: [DONE]"
    order = [orjson.loads(r["body"])["messages"][0]["content"] for r in fake.records()[1:]]
    assert order == ["queued 0", "queued 1", "after the reload"]


def _ask_held(url: str, model: str, mark: str, fake_header: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": mark}], "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=60) as client:
        return client.post(url + CHAT, json=body, headers={"x-fake": fake_header}).status_code


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_reload_lowering_the_limit_applies_while_requests_are_queued(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """max-in-flight 4 with 4 running and 6 queued, reloaded to 1: the queued then run one at a
    time, in order, and none beside the last of the 4 (freed slots were handed on under the old limit)."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake) + "max-in-flight = 4\n")
    gateway = start_gateway({}, "--config", str(path))
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        held = [pool.submit(_ask_held, gateway.url, "a", f"held {i}", "prefill=5") for i in range(4)]
        wait_until(lambda: len(fake.records()) == 4, "4 in flight")
        queued = []
        for index in range(6):
            queued.append(pool.submit(_ask_held, gateway.url, "a", f"queued {index}", "prefill=1"))
            depth = index + 1
            # B023: wait_until calls the lambda before the loop moves on.
            wait_until(lambda: _gauge(gateway, http, "blazar_queue_depth", "a") == depth, "queued")  # noqa: B023

        write_config(path, model_table("a", fake) + "max-in-flight = 1\n")
        assert "updated a (static upstream)" in hang_up(gateway)
        assert [r["finished_at"] for r in fake.records()] == [None] * 4, "the 4 ended before the reload"
        assert [f.result(timeout=60) for f in (*held, *queued)] == [200] * 10
    records = fake.records()
    order = [orjson.loads(r["body"])["messages"][0]["content"] for r in records[4:]]
    assert order == [f"queued {i}" for i in range(6)]
    # Halfway through each queued request, it is the only one the engine has.
    for record in records[4:]:
        middle = (record["received_at"] + record["finished_at"]) / 2
        beside = [r for r in records if r is not record and r["received_at"] < middle < r["finished_at"]]
        assert beside == [], f"{record['body']!r} ran beside {[r['body'] for r in beside]!r}"


def test_sighup_with_a_config_path_that_blocks_leaves_livez_answering(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """The file replaced by a FIFO nobody writes: SIGHUP's read waits off the event loop, so /livez
    and requests still answer; once the FIFO is written, the reload applies what it says."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path))
    fifo = tmp_path / "blazar.fifo"
    os.mkfifo(fifo)
    os.replace(fifo, path)
    gateway.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload: reading" in gateway.log(), "the reload starts reading")
    for _ in range(5):
        assert http.get(gateway.url + "/livez", timeout=3).status_code == 200
        time.sleep(0.1)
    assert ask(gateway, http, "a").status_code == 200
    assert reload_outcomes(gateway) == []  # still reading

    # The reader waits in open(): this open for writing meets it at once.
    with path.open("w", encoding="utf-8") as writer:
        writer.write(model_table("a", fake) + model_table("b", fake))
    wait_until(lambda: bool(reload_outcomes(gateway)), "the reload ends")
    assert reload_outcomes(gateway)[-1].split("reload: ", 1)[1] == "started b"
    assert ask(gateway, http, "b").status_code == 200


def test_sighup_without_changes_changes_nothing(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A reload of an unchanged file says so and keeps serving."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake, "x"))
    gateway = start_gateway({}, "--config", str(path))
    assert "no model changed" in hang_up(gateway)
    assert ask(gateway, http, "x").status_code == 200 and models_seen(fake) == ["a"]


def test_bad_reload_keeps_the_running_configuration(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A reload with any error changes nothing (not even the good parts) and the log says why."""
    fakes = [start_fake_engine() for _ in range(3)]
    path = tmp_path / "blazar.toml"
    good = model_table("a", fakes[0]) + model_table("b", fakes[1], "bee")
    write_config(path, good)
    gateway = start_gateway({}, "--config", str(path))
    moved_a = model_table("a", fakes[2])
    bad_files = [
        ("[models.a\n" + good, "not valid TOML"),
        (model_table("a", fakes[0], "bee") + model_table("b", fakes[1], "bee"), "'bee' is used by both"),
        (moved_a + model_table("b", fakes[1], "a"), "'a' is used by both"),
        (moved_a + model_table("b", fakes[1]) + '[models.c]\nupstrem = "http://h:1"\n', "unknown key"),
        (moved_a + '[models.b]\nupstream = "https://127.0.0.1:1/v1"\n', "only http://"),
        (moved_a + '[models.b]\nengine = "auto"\n', "model is needed"),
        ("[gateway]\nprot = 1\n\n" + moved_a + model_table("b", fakes[1]), "[gateway] prot"),
        ('[gateway]\nport = "abc"\n\n' + good, "[gateway] port"),
        # An editor that truncates before it writes: not applied, or every model would stop.
        ("", "names no models"),
    ]
    for text, why in bad_files:
        write_config(path, text)
        outcome = hang_up(gateway)
        assert "reload failed; the running configuration stays" in outcome, outcome
        assert str(path) in outcome and why in outcome, outcome
        assert served_ids(gateway, http) == ["a", "b"]
        for model in ("a", "b", "bee"):
            assert ask(gateway, http, model).status_code == 200, (why, model)
        assert models_seen(fakes[2]) == [], why

    path.unlink()
    outcome = hang_up(gateway)
    assert "reload failed" in outcome and "cannot read it" in outcome
    assert ask(gateway, http, "bee").status_code == 200

    # The reloader is still alive: a good file is applied.
    write_config(path, moved_a + model_table("b", fakes[1], "bee"))
    assert "updated a (static upstream)" in hang_up(gateway)
    assert ask(gateway, http, "a").status_code == 200 and models_seen(fakes[2]) == ["a"]
    assert models_seen(fakes[0]).count("a") == len(bad_files)
    assert models_seen(fakes[1]).count("b") == 2 * len(bad_files) + 1


def test_reload_adding_an_engine_model_to_an_upstream_only_gateway_reports_errors(
    launch: Launch, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A reload adding a broken engine model to a gateway of static upstreams says why, keeps serving."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    port = free_port()
    gateway = launch(
        "--config", str(path), "--port", str(port), port=port, env={"BLAZAR_HOME": str(tmp_path / "home")}
    )
    write_config(path, model_table("a", fake) + '[models.z]\nengine = "nope-1.0"\n')
    gateway.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload failed" in gateway.log() or "Traceback" in gateway.log(), "the reload to end")
    assert ask(gateway, http, "a").status_code == 200
    assert served_ids(gateway, http) == ["a"]
    assert "Traceback" not in gateway.log(), gateway.log()
    (outcome,) = reload_outcomes(gateway)
    assert "reload failed; the running configuration stays" in outcome
    assert "[models.z]" in outcome and "unknown engine 'nope-1.0'" in outcome


def test_a_reload_naming_a_missing_model_path_changes_nothing_and_installs_nothing(
    launch: Launch, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A reload adding an engine model whose path does not exist says so, installs nothing, keeps serving."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    port = free_port()
    home = tmp_path / "home"
    gateway = launch("--config", str(path), "--port", str(port), port=port, env={"BLAZAR_HOME": str(home)})
    write_config(
        path, model_table("a", fake) + '[models.z]\nengine = "mlx-0.32.0"\nmodel = "/no/such/model"\n'
    )
    outcome = hang_up(gateway)
    assert outcome.startswith("blazar-proxy: reload failed; the running configuration stays: ")
    assert f"{path}: [models.z] model: /no/such/model does not exist" in outcome
    assert not (home / "engines").exists()
    assert served_ids(gateway, http) == ["a"] and ask(gateway, http, "a").status_code == 200


def test_reload_says_gateway_settings_wait_for_a_restart(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A changed [gateway] table on reload is reported as needing a restart; models still reload."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, "[gateway]\nmax-queued = 10\n\n" + model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path))
    write_config(path, "[gateway]\nmax-queued = 20\n\n" + model_table("a", fake) + model_table("b", fake))
    assert "started b" in hang_up(gateway)
    wait_until(lambda: "take effect on restart" in gateway.log(), "the [gateway] change is reported")
    assert "max_queued" in gateway.log() or "max-queued" in gateway.log()
    assert ask(gateway, http, "b").status_code == 200


@pytest.mark.parametrize("where", ["command line", "file"])
def test_watch_config_picks_up_edits_without_a_signal(
    start_gateway: StartGateway,
    start_fake_engine: StartFakeEngine,
    http: httpx.Client,
    tmp_path: Path,
    where: str,
) -> None:
    """--watch-config (flag or [gateway] key): edits apply within seconds without a signal; bad ones not."""
    one, two = start_fake_engine(), start_fake_engine()
    path = tmp_path / "blazar.toml"
    head = "[gateway]\nwatch-config = true\n\n" if where == "file" else ""
    write_config(path, head + model_table("a", one))
    flags = ("--watch-config",) if where == "command line" else ()
    gateway = start_gateway({}, "--config", str(path), *flags)

    write_config(path, head + model_table("a", one) + model_table("c", two, "see"))
    wait_until(lambda: served_ids(gateway, http) == ["a", "c"], "the watcher adds c")
    assert ask(gateway, http, "see").status_code == 200 and models_seen(two) == ["c"]

    write_config(path, head + "[models.a\n")
    wait_until(lambda: "reload failed" in gateway.log(), "the watcher reports the bad edit")
    assert "not valid TOML" in gateway.log()
    assert served_ids(gateway, http) == ["a", "c"]
    assert ask(gateway, http, "a").status_code == 200

    write_config(path, head + model_table("a", one))
    wait_until(lambda: served_ids(gateway, http) == ["a"], "the watcher removes c")
    assert ask(gateway, http, "c").status_code == 404


def test_without_watch_config_an_edit_waits_for_sighup(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """Without --watch-config, an edited file is not applied until SIGHUP."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path))
    write_config(path, model_table("a", fake) + model_table("c", fake))
    time.sleep(2.5)  # more than two polls of a watcher, were there one
    assert served_ids(gateway, http) == ["a"]
    assert "started c" in hang_up(gateway)
    assert served_ids(gateway, http) == ["a", "c"]


def test_command_line_models_survive_reloads(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """--upstream models stay through reloads; a file model that takes one's name (or alias) is refused."""
    cli, first, second = start_fake_engine(), start_fake_engine(), start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", first))
    gateway = start_gateway({"x": cli.url}, "--config", str(path))
    assert served_ids(gateway, http) == ["x", "a"]

    write_config(path, model_table("d", second))
    outcome = hang_up(gateway)
    assert "removed a" in outcome and "started d" in outcome
    assert served_ids(gateway, http) == ["x", "d"]
    assert ask(gateway, http, "x").status_code == 200 and models_seen(cli) == ["x"]

    for text, why in (
        (model_table("d", second) + model_table("x", second), "also given on the command line"),
        (model_table("d", second, "x"), "'x'"),
    ):
        write_config(path, text)
        outcome = hang_up(gateway)
        assert "reload failed; the running configuration stays" in outcome and why in outcome, outcome
        assert served_ids(gateway, http) == ["x", "d"]
        assert ask(gateway, http, "x").status_code == 200
    assert models_seen(cli) == ["x"] * 3 and models_seen(second) == []

    write_config(path, "")
    assert "removed d" in hang_up(gateway)
    assert served_ids(gateway, http) == ["x"]
    assert ask(gateway, http, "x").status_code == 200


# -- admin endpoints on static models ---------------------------------------------------


def test_admin_load_and_unload_of_a_static_upstream_is_409(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """load/unload of a static upstream (by name or alias) is 409 not_an_engine_model; unknown is 404."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake, "al"))
    gateway = start_gateway({}, "--config", str(path))
    for name in ("a", "al"):
        for verb in ("load", "unload"):
            response = http.post(f"{gateway.url}/admin/models/{name}/{verb}")
            assert response.status_code == 409, response.text
            error = error_of(response)
            assert error["code"] == "not_an_engine_model" and error["param"] == "model"
            assert error["type"] == "invalid_request_error" and "`a`" in error["message"]
    for verb in ("load", "unload"):
        response = http.post(f"{gateway.url}/admin/models/nope/{verb}")
        assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"
    assert http.get(gateway.url + "/v1/models").json()["data"][0]["state"] == "loaded"
    assert fake.records() == []


def test_admin_endpoints_refuse_a_cross_origin_form_post(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """A web page's text/plain POST (no preflight) cannot load or unload models; an allowed origin can."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path), "--cors-origin", "https://app.example")
    for verb in ("load", "unload"):
        response = http.post(
            f"{gateway.url}/admin/models/a/{verb}",
            content=b"x",
            headers={"origin": "https://evil.example", "content-type": "text/plain"},
        )
        assert response.status_code == 403, response.text
        assert error_of(response)["code"] == "origin_not_allowed"
        allowed = http.post(f"{gateway.url}/admin/models/a/{verb}", headers={"origin": "https://app.example"})
        assert allowed.status_code == 409  # past the origin check: a static upstream has nothing to load


def test_admin_endpoints_need_the_files_api_key(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """With api-key set in the file, the admin endpoints answer 401 without it and work with it."""
    fake = start_fake_engine()
    path = tmp_path / "blazar.toml"
    write_config(path, '[gateway]\napi-key = ["k1", "k2"]\n\n' + model_table("a", fake))
    gateway = start_gateway({}, "--config", str(path))
    for url in (f"{gateway.url}/admin/models/a/load", f"{gateway.url}/admin/models/nope/unload"):
        response = http.post(url)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
        assert http.post(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert http.post(f"{gateway.url}/admin/models/a/load", headers={"x-api-key": "k2"}).status_code == 409
    response = http.post(f"{gateway.url}/admin/models/nope/load", headers={"authorization": "Bearer k1"})
    assert response.status_code == 404
