"""The matrix's goals can fail: a figure that cannot decide a goal never counts as met.

Figures are made up here; nothing is measured.
"""

from __future__ import annotations

from typing import Any

from perf.matrix import Plan, goals, round_order
from perf.report import _met


def _row(
    surface: str, workload: str, c: int, *, runs: int = 3, duration_s: float = 3.0, **figures: float
) -> dict[str, Any]:
    return {
        "workload": workload,
        "concurrency": c,
        "surface": surface,
        "runs": [{"duration_s": duration_s} for _ in range(runs)],
        **figures,
    }


def _rows(
    *, blazar_p50: float = 0.15, nginx_p50: float = 0.025, blazar_p99: float = 0.3, **kw: Any
) -> list[dict[str, Any]]:
    return [
        _row("direct", "json", 1, **kw, p50_ms=0.02, cpu_us_per_request=15.0),
        _row(
            "blazar",
            "json",
            1,
            **kw,
            added_p50_ms=blazar_p50,
            added_p99_ms=blazar_p99,
            cpu_us_per_request=120.0,
        ),
        _row("nginx", "json", 1, **kw, added_p50_ms=nginx_p50, added_p99_ms=0.05, cpu_us_per_request=25.0),
        _row("blazar", "json", 64, rps=5000.0, cpu_us_per_request=100.0),
        _row("nginx", "json", 64, rps=30000.0, cpu_us_per_request=20.0),
    ]


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {goal["goal"]: goal for goal in goals(rows)}


def test_a_negative_added_p99_is_not_met() -> None:
    goal = _by_name(_rows(blazar_p99=-5.029))["added p99 at C=1 (json)"]
    assert goal["met"] is None and "not resolved" in goal["why"]
    assert _met(goal).startswith("**not judged**")


def test_an_added_p99_from_short_cells_is_not_judged() -> None:
    goal = _by_name(_rows(runs=1, duration_s=1.0))["added p99 at C=1 (json)"]
    assert goal["met"] is None and "needs 3 runs" in goal["why"]


def test_an_added_p99_over_the_limit_fails() -> None:
    assert _by_name(_rows(blazar_p99=0.8))["added p99 at C=1 (json)"]["met"] is False
    assert _by_name(_rows(blazar_p99=0.3))["added p99 at C=1 (json)"]["met"] is True


def test_a_ratio_to_an_added_figure_at_or_below_zero_is_not_judged() -> None:
    assert _by_name(_rows(nginx_p50=-0.004))["added p50 at C=1 (json)"]["met"] is None
    assert _by_name(_rows(blazar_p50=-0.01))["added p50 at C=1 (json)"]["met"] is None
    assert _by_name(_rows(blazar_p50=0.15, nginx_p50=0.025))["added p50 at C=1 (json)"]["met"] is False
    assert _by_name(_rows(blazar_p50=0.09, nginx_p50=0.025))["added p50 at C=1 (json)"]["met"] is True


def test_cpu_per_request_is_a_goal_at_c1_and_c64() -> None:
    found = _by_name(_rows())
    assert found["CPU per request at C=1 (json)"]["ratio"] == 120.0 / 25.0
    assert found["CPU per request at C=1 (json)"]["met"] is False
    assert found["CPU per request at C=64 (json)"]["ratio"] == 5.0
    assert found["req/s at C=64 (json)"]["met"] is False


def test_the_goal_cells_run_long_enough_whatever_the_plan() -> None:
    plan = Plan(duration_s=1.0, rounds=1)
    assert plan.shape("json", 1) == (3, 3.0)
    assert plan.shape("json", 64) == (3, 3.0)
    assert plan.shape("json", 16) == (1, 1.0)
    # Every cell a goal reads rotates the order over several rounds; only json's run longer.
    assert plan.shape("sse", 1) == (3, 1.0)
    assert plan.shape("sse", 16) == (3, 1.0)
    assert plan.shape("sse", 64) == (1, 1.0)
    assert plan.shape("sse-4ms", 16) == (1, 1.0)
    assert Plan(duration_s=1.0, rounds=1, goal_duration_s=0, goal_rounds=0).shape("json", 1) == (1, 1.0)


def test_of_two_surfaces_next_to_each_other_neither_always_follows_the_other() -> None:
    """Over a goal cell's three rounds, each surface goes first once at most, and blazar follows
    blazar-base as often as blazar-base follows blazar."""
    names = ["direct", "blazar", "blazar-base", "nginx", "floor"]
    orders = [round_order(names, index) for index in range(3)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert len({order[0] for order in orders}) == 3

    def follows(later: str, earlier: str) -> int:
        return sum(order.index(later) == order.index(earlier) + 1 for order in orders)

    assert follows("blazar-base", "blazar") == follows("blazar", "blazar-base") == 1
