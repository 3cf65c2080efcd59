"""LiteLLM's proxy as an optional matrix surface: found when installed, said to be missing otherwise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from perf import report, surfaces
from perf.matrix import Plan, _start_litellm


def test_config_routes_each_model_to_its_engine_as_openai() -> None:
    """The config names each fake engine as an openai/<name> model with its api_base, and no master key."""
    text = surfaces.litellm_config({"m1": "http://127.0.0.1:9001", "m2": "http://127.0.0.1:9002"})
    assert "  - model_name: m1\n    litellm_params:\n      model: openai/m1\n" in text
    assert "      api_base: http://127.0.0.1:9001/v1\n" in text
    assert "      api_base: http://127.0.0.1:9002/v1\n" in text
    assert "forward_client_headers_to_llm_api: true" in text
    assert "\n  master_key:" not in text


def test_find_litellm_is_none_where_it_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No litellm on PATH, a missing $BLAZAR_PERF_LITELLM_PYTHON, none in this Python: None, no error."""
    if importlib.util.find_spec("litellm") is not None:
        pytest.skip("litellm is installed in the test's own Python")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(surfaces.LITELLM_ENV, str(tmp_path / "no-such-python"))
    assert surfaces.find_litellm() is None


def test_matrix_without_litellm_says_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """LiteLLM missing: the matrix starts no surface for it and the report says 'LiteLLM: not installed'."""
    monkeypatch.setattr(surfaces, "find_litellm", lambda: None)
    procs: dict[str, surfaces.Process] = {}
    info = _start_litellm(Plan(), {"m1": "http://127.0.0.1:9"}, tmp_path, procs)
    assert procs == {}
    assert info["status"] == "not installed"
    lines = report.litellm_markdown({"litellm": info, "rows": []})
    assert any(line.startswith("LiteLLM: not installed") for line in lines)


def test_matrix_smoke_plan_leaves_litellm_out(tmp_path: Path) -> None:
    """A plan without the litellm surface does not look for it (the smoke run stays seconds)."""
    info = _start_litellm(Plan(surfaces=("direct", "blazar")), {}, tmp_path, {})
    assert info == {"status": "not in this plan"}
