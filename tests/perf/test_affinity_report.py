"""`python -m perf affinity`: its figures, goals and report, from made-up turns (no engine, no timing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engines import spec
from engines.plan import check_engine_args
from perf.affinity import (
    AFFINITY_FLAG,
    ENGINE,
    MODEL_TABLE,
    AffinityPlan,
    ModeResult,
    Turn,
    _config,
    _Router,
    cache_peak,
    cached_fraction,
    decision_cost,
    engine_args,
    markdown,
    max_share,
    merge,
    misses,
    prompt_cache,
    summarize,
    system_prompt,
    think_time,
    ttft_p90_ms,
)
from proxy.startup import configfile


def turn(number: int, prompt: int, cached: int, ttft_s: float, conversation: int = 0) -> Turn:
    return Turn(conversation, number, prompt, cached, ttft_s, ttft_s + 0.1, 8)


def test_cached_fraction_weighs_turns_by_their_prompt_tokens() -> None:
    """The cached fraction is cached tokens over prompt tokens of all the turns, not a mean of ratios."""
    assert cached_fraction([turn(2, 1000, 900, 0.1), turn(2, 100, 0, 1.0)]) == 900 / 1100
    assert cached_fraction([]) is None


def test_max_share_is_the_busiest_replicas_share() -> None:
    """The load split's figure is the busiest replica's share; one replica has none."""
    assert max_share([18, 14]) == 18 / 32
    assert max_share([32]) is None
    assert max_share([0, 0]) is None


def test_goals_compare_affinity_with_one_replica_and_with_least_busy() -> None:
    """Cached fraction against one replica alone, TTFT p50 against least-busy, share at most 0.6."""

    def mode(name: str, cached: int, ttft_s: float, served: list[int]) -> ModeResult:
        turns = [turn(1, 1000, 0, 5.0)] + [turn(n, 1000, cached, ttft_s) for n in (2, 3, 4)]
        return ModeResult(name, turns=turns, served=served)

    results = [
        mode("single", 950, 0.3, [4]),
        mode("least-busy", 500, 1.2, [2, 2]),
        ModeResult("affinity", skipped="the gateway has no flag"),
        mode("client-affinity", 900, 0.4, [3, 1]),
    ]
    summary = summarize(results, turns=4)
    goals = {g["goal"]: g for g in summary["goals"]}
    assert {g["mode"] for g in summary["goals"]} == {"client-affinity"}
    cached = goals["cached fraction, turns 2+, vs one replica alone"]
    assert abs(cached["value"] - 900 / 950) < 1e-9 and cached["met"] is True
    ttft = goals["TTFT p50, turns 2+: least-busy / affinity"]
    assert abs(ttft["value"] - 3.0) < 1e-9 and ttft["met"] is True
    share = goals["busiest replica's share of requests"]
    assert share["value"] == 0.75 and share["met"] is False
    assert summary["modes"]["affinity"] == {"skipped": "the gateway has no flag"}
    assert summary["modes"]["single"]["turns"]["1"]["cached_fraction"] == 0.0


def test_markdown_has_a_row_per_turn_the_split_and_the_goals() -> None:
    """The report has a row per turn and one for turns 2+, the load split, the goals, the skipped mode."""
    plan = AffinityPlan(turns=2)
    results = [
        ModeResult("single", turns=[turn(1, 100, 0, 1.0), turn(2, 120, 100, 0.2)], served=[2]),
        ModeResult("least-busy", turns=[turn(1, 100, 0, 1.0), turn(2, 120, 0, 0.9)], served=[1, 1]),
        ModeResult("affinity", skipped=f"the gateway has no {AFFINITY_FLAG} yet"),
    ]
    data: dict[str, Any] = {
        "plan": {**plan.__dict__},
        "prompt_cache": prompt_cache(plan),
        "engine": "mlx-0.32.0",
        "model": "m",
        "summary": summarize(results, turns=2),
        "environment": {"git_sha": "abc"},
        "decision_cost": {"body_bytes": 7000.0, "key_us": 6.0, "choose_us": 9.0, "parse_us": 0.1},
    }
    text = markdown(data)
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2")]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2", "2+"]
    assert "| least-busy | 1 / 1 | 0.50 |" in text
    assert f"not measured: the gateway has no {AFFINITY_FLAG} yet" in text
    assert "`choose`" in text and "9.0 µs" in text
    assert "Prompt cache per child: the engine's default (10 caches, bytes unbounded)." in text


def test_rounds_pool_their_turns_and_requests() -> None:
    """Merging a second round adds its turns, requests per replica and affinity counters."""
    pooled = ModeResult("client-affinity")
    for _ in range(2):
        merge(
            pooled,
            ModeResult(
                "client-affinity",
                turns=[turn(1, 10, 0, 1.0)],
                served=[3, 1],
                wall_s=2.0,
                affinity={"hits": [1, 0], "misses": [2, 1], "spills": [0, 0]},
            ),
        )
    assert len(pooled.turns) == 2
    assert pooled.served == [6, 2]
    assert pooled.wall_s == 4.0
    assert pooled.affinity == {"hits": [2, 0], "misses": [4, 2], "spills": [0, 0]}


def test_the_workload_is_the_same_in_every_mode() -> None:
    """System prompts are each conversation's own and of the asked length; pauses depend on the seed only."""
    plan = AffinityPlan()
    first, second = system_prompt(0, 1500, 14), system_prompt(1, 1500, 14)
    assert len(first) == len(second) == 1500 and first != second
    assert system_prompt(0, 1500, 14) == first
    assert think_time(3, 1, plan) == 0.0
    pauses = [think_time(c, t, plan) for c in range(8) for t in (2, 3, 4)]
    assert pauses == [think_time(c, t, plan) for c in range(8) for t in (2, 3, 4)]
    assert all(0 <= p <= 2 * plan.think_s for p in pauses) and len(set(pauses)) == len(pauses)


def test_the_client_router_counts_its_own_requests_in_flight() -> None:
    """The harness-side router keeps a conversation on its child while loads allow (proxy.affinity)."""
    router = _Router(["http://a", "http://b"], slack=1)
    doc = {"messages": [{"role": "system", "content": "x" * 3000}, {"role": "user", "content": "q"}]}
    first = router.enter(doc)
    assert router.loads[first] == 1
    other = router.enter({"messages": [{"role": "user", "content": "another " * 300}]})
    assert other != first
    router.leave(other)
    doc["messages"] += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert router.enter(doc) == first  # busier by one: within the slack
    assert router.loads == ([2, 0] if first == 0 else [0, 2])


def test_decision_cost_is_measured() -> None:
    """The decision's cost is measured on a real-sized body and comes out positive."""
    cost = decision_cost(repeat=1, number=50)
    assert cost["body_bytes"] > 6000
    assert cost["key_us"] > 0 and cost["choose_us"] > 0


def _no_gateway_table(key: str, value: Any) -> tuple[str, Any]:
    raise ValueError(f"the harness writes no [gateway] table, got {key}")


def test_a_bounded_prompt_cache_reaches_the_children_through_engine_args(tmp_path: Path) -> None:
    """--prompt-cache-size/-bytes go into the model's engine-args, as the gateway reads its config file."""
    path = tmp_path / "affinity.toml"
    path.write_text(_config(AffinityPlan(), 2))
    (default,) = configfile.load(path, _no_gateway_table).models
    assert default.name == MODEL_TABLE and default.replicas == 2 and default.engine_args == ()

    plan = AffinityPlan(prompt_cache_size=5, prompt_cache_bytes="512M")
    path.write_text(_config(plan, 2))
    (bounded,) = configfile.load(path, _no_gateway_table).models
    assert bounded.engine_args == ("--prompt-cache-size", "5", "--prompt-cache-bytes", "512M")
    assert list(bounded.engine_args) == engine_args(plan)
    check_engine_args(spec.load(ENGINE), bounded.engine_args)  # none of the gateway's own flags


def test_the_report_states_the_cache_used_and_the_engines_default() -> None:
    """The header and the JSON name the cache setting, beside the engine's default of 10 caches."""
    plan = AffinityPlan(turns=1, prompt_cache_size=5)
    results = [ModeResult("single", turns=[turn(1, 100, 0, 1.0)], served=[1], cache_peak=[5])]
    data: dict[str, Any] = {
        "plan": {**plan.__dict__},
        "prompt_cache": prompt_cache(plan),
        "engine": ENGINE,
        "model": "m",
        "summary": summarize(results, turns=1),
        "environment": {},
    }
    assert json.loads(json.dumps(data["prompt_cache"])) == {
        "size": 5,
        "bytes": None,
        "default_size": 10,
        "default_bytes": None,
        "engine_args": ["--prompt-cache-size", "5"],
    }
    text = markdown(data)
    assert (
        "Prompt cache per child: `--prompt-cache-size 5` (engine default: 10 caches, bytes unbounded)."
        in text
    )
    assert "| single | 1 | — | 5 | " in text  # the most caches the child held
    both = prompt_cache(AffinityPlan(prompt_cache_size=4, prompt_cache_bytes="1G"))
    assert "`--prompt-cache-size 4` `--prompt-cache-bytes 1G`" in markdown({**data, "prompt_cache": both})


def test_the_most_caches_held_is_read_from_the_childs_log_and_pooled_by_maximum() -> None:
    """mlx_lm.server logs its prompt cache's size per request; rounds keep each child's largest."""
    log = (
        b"2026-12-01 14:38:18,855 - INFO - Prompt Cache: 3 sequences, 0.01 GB\n"
        b"2026-12-01 14:38:18,855 - INFO - - assistant: 3 sequences, 0.01 GB\n"
        b"2026-12-01 14:38:19,101 - INFO - Prompt Cache: 5 sequences, 0.02 GB\n"
        b"2026-12-01 14:38:19,300 - INFO - Prompt Cache: 4 sequences, 0.02 GB\n"
    )
    assert cache_peak(log) == 5
    assert cache_peak(b"no such line") == 0
    pooled = ModeResult("affinity")
    merge(pooled, ModeResult("affinity", served=[1, 1], cache_peak=[5, 3]))
    merge(pooled, ModeResult("affinity", served=[1, 1], cache_peak=[4, 5]))
    assert pooled.cache_peak == [5, 5]


def test_later_turns_count_their_misses_and_the_ttft_spread() -> None:
    """Turns 2+ report how many found under half their prompt cached, and TTFT p90 and mean beside p50."""
    later = [
        turn(2, 1000, 900, 0.1),
        turn(3, 1000, 950, 0.2),
        turn(4, 1000, 400, 5.0),
        turn(2, 1000, 499, 3.0),
    ]
    assert misses(later) == 2  # 400 and 499 of 1000; 500 would count as cached
    assert misses([turn(2, 1000, 500, 1.0)]) == 0
    assert ttft_p90_ms([turn(2, 10, 0, 1.0)]) == 1000.0 and ttft_p90_ms([]) is None
    p90 = ttft_p90_ms(later)
    assert p90 is not None and 3000 < p90 < 5000
    summary = summarize([ModeResult("least-busy", turns=[turn(1, 1000, 0, 9.0), *later], served=[3, 2])], 4)
    mode = summary["modes"]["least-busy"]
    assert (mode["later_misses"], mode["later_turns"]) == (2, 4)
    assert abs(mode["later_ttft_mean_ms"] - 2075.0) < 1e-6
    text = markdown(
        {
            "plan": {**AffinityPlan().__dict__},
            "engine": ENGINE,
            "model": "m",
            "summary": summary,
            "environment": {},
        }
    )
    assert f"| least-busy | 2 of 4 | 1600 ms | {p90:.0f} ms | 2075 ms |" in text
