"""Portkey's gateway as an optional matrix surface: found when installed, said to be missing otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import report, surfaces
from perf.matrix import DEFAULT_SURFACES, SURFACES, Plan, _start_portkey

PORTKEY = surfaces.Portkey("/usr/bin/node", "/x/build/start-server.js", "1.15.2", "test")


def _fake_package(root: Path, name: str = "@portkey-ai/gateway") -> Path:
    package = root / "node_modules" / "@portkey-ai" / "gateway"
    (package / "build").mkdir(parents=True)
    (package / "build" / "start-server.js").write_text("")
    (package / "package.json").write_text(json.dumps({"name": name, "version": "9.9.9"}))
    return package


def test_command_runs_the_server_headless_on_its_port() -> None:
    """start-server.js --port=N --headless, NODE_ENV=production: no console, no log stream."""
    assert surfaces.portkey_command(PORTKEY, 4321) == [
        "/usr/bin/node",
        "/x/build/start-server.js",
        "--port=4321",
        "--headless",
    ]
    assert surfaces.portkey_env()["NODE_ENV"] == "production"
    assert "portkey" in SURFACES and "portkey" in DEFAULT_SURFACES


def test_one_upstream_is_routed_by_the_documented_headers() -> None:
    """Provider openai at the upstream's /v1 as custom host; x-fake forwarded to the upstream."""
    headers = surfaces.portkey_headers({"m1": "http://127.0.0.1:9001"})
    assert headers == {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": "http://127.0.0.1:9001/v1",
        "x-portkey-forward-headers": "x-fake",
    }


def test_two_upstreams_are_routed_by_model_with_a_conditional_config() -> None:
    """Each model's target at its engine's /v1, picked by params.model; valid per Portkey's schema."""
    headers = surfaces.portkey_headers({"m1": "http://127.0.0.1:9001", "m2": "http://127.0.0.1:9002"})
    assert headers["x-portkey-forward-headers"] == "x-fake"
    config = json.loads(headers["x-portkey-config"])
    assert config["strategy"]["mode"] == "conditional"
    assert config["strategy"]["conditions"] == [
        {"query": {"params.model": {"$eq": "m1"}}, "then": "m1"},
        {"query": {"params.model": {"$eq": "m2"}}, "then": "m2"},
    ]
    targets = {t["name"]: t for t in config["targets"]}
    assert targets["m2"]["custom_host"] == "http://127.0.0.1:9002/v1"
    # Portkey refuses a target with a provider but no api_key.
    assert all(t["provider"] == "openai" and t["api_key"] for t in config["targets"])


def test_find_portkey_reads_the_package_under_the_env_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """$BLAZAR_PERF_PORTKEY_DIR may be the npm prefix or the package; the version is the package's."""
    package = _fake_package(tmp_path)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/node" if name == "node" else None)
    for where in (tmp_path, package):
        monkeypatch.setenv(surfaces.PORTKEY_ENV, str(where))
        found = surfaces.find_portkey()
        assert found is not None
        assert (found.version, found.node) == ("9.9.9", "/usr/bin/node")
        assert found.entry == str(package / "build" / "start-server.js")


def test_find_portkey_is_none_where_it_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No such directory, another package there, or no node: None, no error."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(surfaces.PORTKEY_ENV, str(tmp_path / "nothing-here"))
    assert surfaces.find_portkey() is None
    _fake_package(tmp_path, name="someone-else")
    monkeypatch.setenv(surfaces.PORTKEY_ENV, str(tmp_path))
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/node" if name == "node" else None)
    assert surfaces.find_portkey() is None
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert surfaces.find_portkey() is None


def test_matrix_without_portkey_says_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Portkey missing: the matrix starts no surface for it and the report says 'Portkey: not installed'."""
    monkeypatch.setattr(surfaces, "find_portkey", lambda: None)
    procs: dict[str, surfaces.Process] = {}
    info = _start_portkey(Plan(), {"m1": "http://127.0.0.1:9"}, tmp_path, procs)
    assert procs == {}
    assert info["status"] == "not installed"
    data = {"portkey": info, "litellm": {"status": "not installed"}, "rows": []}
    assert any(line.startswith("Portkey: not installed") for line in report.portkey_markdown(data))
    assert report.peers_markdown(data) == []


def test_smoke_plan_leaves_portkey_out(tmp_path: Path) -> None:
    info = _start_portkey(Plan(surfaces=("direct", "blazar")), {}, tmp_path, {})
    assert info == {"status": "not in this plan"}


def test_peers_table_gives_ratios_to_nginx_and_blazar() -> None:
    """A measured peer: its figure, then figure ÷ nginx's and ÷ blazar's."""

    def row(surface: str, c: int, **figures: float) -> dict[str, object]:
        return {"workload": "json", "concurrency": c, "surface": surface, "requests": 10, **figures}

    rows = [
        row("nginx", 1, added_p50_ms=0.05, cpu_us_per_request=50.0),
        row("blazar", 1, added_p50_ms=0.2, cpu_us_per_request=200.0),
        row("portkey", 1, added_p50_ms=2.0, cpu_us_per_request=1000.0),
        row("nginx", 64, rps=10000.0, cpu_us_per_request=40.0),
        row("blazar", 64, rps=4000.0, cpu_us_per_request=160.0),
        row("portkey", 64, rps=400.0, cpu_us_per_request=800.0),
    ]
    data = {"portkey": {"status": "measured"}, "rows": rows, "plan": {"duration_s": 1.0}}
    lines = report.peers_markdown(data)
    assert "| figure | nginx | blazar | portkey | portkey ÷ nginx | portkey ÷ blazar |" in lines
    assert "| added p50 at C=1 (json), ms | 0.050 | 0.200 | 2.000 | 40.0× | 10.0× |" in lines
    assert "| req/s at C=64 (json) | 10000 | 4000 | 400 | 0.040× | 0.100× |" in lines
    assert "| CPU µs per request at C=64 (json) | 40.0 | 160.0 | 800.0 | 20.0× | 5.0× |" in lines
