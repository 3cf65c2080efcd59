"""proxy.startup.catalog: model settings into routes, reload planning, and reloads applied, without sockets.

Engine models are assembled from hand-planned children (a real ``ChildConfig``
and the real engine spec): nothing is installed and no child starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engines import spec as specs
from engines.child import ChildState
from engines.plan import PlannedChild
from engines.registry import Registry
from engines.served import Lifetime, ModelState, ServedModel
from proxy.relay import Relay
from proxy.routing import Route, RoutingTable, UpstreamAddress
from proxy.startup.catalog import Catalog, ReloadPlan, _Prepared, plan_reload
from proxy.startup.configfile import ConfigError, FileConfig, ModelConfig
from proxy.startup.settings import Settings
from tests.engines.test_child import config as child_config

MLX = "mlx-0.32.0"
FILE = Path("/etc/blazar.toml")


def engine(name: str, **settings: Any) -> ModelConfig:
    """An engine model as the file's ``[models.NAME]`` table gives it."""
    return ModelConfig(
        name=name, engine=MLX, model=f"/models/{name}", source=f"{FILE}: [models.{name}]", **settings
    )


def upstream(name: str, url: str = "http://127.0.0.1:9001/v1", **settings: Any) -> ModelConfig:
    """A static upstream as the file's ``[models.NAME]`` table gives it."""
    return ModelConfig(name=name, upstream=url, source=f"{FILE}: [models.{name}]", **settings)


def file(*models: ModelConfig) -> FileConfig:
    return FileConfig(path=FILE, models=models)


# -- plan_reload: what a reload changes, decided before anything is built --------


def test_an_unchanged_file_changes_nothing() -> None:
    """The same models with the same settings: no plan (the reload says so and stops)."""
    running = {"a": engine("a"), "b": upstream("b")}
    assert plan_reload(running, file(engine("a"), upstream("b")), keep=()) is None


def test_where_a_setting_was_given_is_not_a_change() -> None:
    """``source`` only names the place for error messages; moving a table does not restart it."""
    moved = dataclasses.replace(engine("a"), source="elsewhere")
    assert plan_reload({"a": engine("a")}, file(moved), keep=()) is None


def test_a_new_model_is_built_and_started() -> None:
    """A name not served yet is rebuilt (built), replaces nothing, and is reported as started."""
    changes = plan_reload({"a": engine("a")}, file(engine("a"), engine("b")), keep=())
    assert changes == ReloadPlan(rebuilt=(engine("b"),))
    assert changes.report() == "started b"


@pytest.mark.parametrize(
    "setting",
    [{"model": "/models/other"}, {"replicas": 2}, {"engine_args": ("--x",)}, {"variant": "cpu"}],
    ids=lambda s: next(iter(s)),
)
def test_a_change_to_the_children_restarts_them(setting: dict[str, object]) -> None:
    """Model, replicas, engine arguments or variant changed: new children replace the old ones."""
    new = dataclasses.replace(engine("a"), **setting)  # type: ignore[arg-type]
    changes = plan_reload({"a": engine("a")}, file(new), keep=())
    assert changes == ReloadPlan(rebuilt=(new,), replaced=("a",))
    assert changes.report() == "restarted a"


@pytest.mark.parametrize(
    "setting",
    [
        {"aliases": ("gpt",)},
        {"ttl_s": 60.0},
        {"always_loaded": True},
        {"max_in_flight": 3},
        {"allow_fields": ("adapters",)},
    ],
    ids=lambda s: next(iter(s)),
)
def test_a_change_beside_the_children_keeps_them(setting: dict[str, object]) -> None:
    """Aliases, TTL, always-loaded or the limit changed on an engine model: retuned, children kept."""
    new = dataclasses.replace(engine("a"), **setting)  # type: ignore[arg-type]
    changes = plan_reload({"a": engine("a")}, file(new), keep=())
    assert changes == ReloadPlan(retuned=(new,))
    assert changes.report() == "updated a (children kept)"


def test_a_static_upstream_s_route_is_rebuilt_on_any_change() -> None:
    """A static upstream has no children to keep: an alias change rebuilds its (cheap) route."""
    new = upstream("b", aliases=("gpt",))
    changes = plan_reload({"b": upstream("b")}, file(new), keep=())
    assert changes == ReloadPlan(rebuilt=(new,), replaced=("b",), rerouted=("b",))


def test_reload_of_a_static_upstream_is_not_reported_as_a_restart() -> None:
    """A static upstream rebuilt (alias, limit, URL) is reported updated: it has no children to restart."""

    def report(running: ModelConfig, wanted: ModelConfig) -> str:
        changes = plan_reload({str(running.name): running}, file(wanted), keep=())
        assert changes is not None
        return changes.report()

    assert report(upstream("b"), upstream("b", aliases=("gpt",))) == "updated b (static upstream)"
    assert report(upstream("b"), upstream("b", max_in_flight=2)) == "updated b (static upstream)"
    assert (
        report(upstream("b"), upstream("b", url="http://127.0.0.1:9002/v1")) == "updated b (static upstream)"
    )
    # A static upstream turned into an engine model, or back: children start or stop.
    assert report(upstream("b"), engine("b")) == "restarted b"
    assert report(engine("b"), upstream("b")) == "restarted b"
    running = {"a": engine("a"), "b": upstream("b"), "c": upstream("c")}
    moved = dataclasses.replace(engine("a"), model="/models/other")
    changes = plan_reload(
        running, file(moved, upstream("b", aliases=("gpt",)), upstream("c", ttl_s=5.0)), keep=()
    )
    assert changes is not None and changes.report() == "restarted a; updated b, c (static upstream)"


def test_an_engine_model_turned_into_a_static_upstream_is_rebuilt() -> None:
    """Same name, now an upstream URL: its children go, a plain route comes."""
    new = upstream("a")
    changes = plan_reload({"a": engine("a")}, file(new), keep=())
    assert changes is not None and changes.rebuilt == (new,) and changes.retuned == ()


def test_naming_an_upstream_s_engine_rebuilds_its_route() -> None:
    """engine added beside an upstream changes its guards: the route is built again."""
    new = upstream("b", engine=MLX)
    assert plan_reload({"b": upstream("b")}, file(new), keep=()) == ReloadPlan(
        rebuilt=(new,), replaced=("b",), rerouted=("b",)
    )


def test_a_model_the_file_no_longer_names_is_removed_but_command_line_ones_stay() -> None:
    """Removed: the file's models it dropped; the command line's models (keep) are never touched."""
    running = {"cli": engine("cli"), "a": engine("a"), "b": upstream("b")}
    changes = plan_reload(running, file(engine("a")), keep=("cli",))
    assert changes == ReloadPlan(removed=("b",))
    assert changes.report() == "removed b"


def test_a_file_emptied_beside_command_line_models_removes_the_file_s_models() -> None:
    """No models in the file is fine when the command line still serves one."""
    changes = plan_reload({"cli": engine("cli"), "a": engine("a")}, file(), keep=("cli",))
    assert changes == ReloadPlan(removed=("a",))


def test_a_file_with_no_models_and_nothing_else_served_is_not_applied() -> None:
    """An editor that truncates the file before writing it must not stop every model."""
    with pytest.raises(ConfigError, match="names no models, and nothing else would be served; not applied"):
        plan_reload({"a": engine("a")}, file(), keep=())


def test_a_name_the_command_line_serves_cannot_come_from_the_file() -> None:
    """The file naming a command-line model is refused, naming it."""
    with pytest.raises(ConfigError, match="model 'cli' is also given on the command line"):
        plan_reload({"cli": engine("cli")}, file(engine("cli")), keep=("cli",))


def test_a_name_used_twice_in_the_file_is_refused() -> None:
    """A model name that is another's alias is refused before anything is planned."""
    with pytest.raises(ConfigError, match="model name 'a' is used by both 'a' and 'b'"):
        plan_reload({}, file(engine("a"), engine("b", aliases=("a",))), keep=())


def test_a_mixed_reload_is_reported_in_one_line() -> None:
    """New, restarted, removed and retuned models, each said once, in that order."""
    running = {"a": engine("a"), "b": engine("b"), "c": engine("c")}
    changes = plan_reload(
        running, file(engine("a", ttl_s=5.0), engine("b", replicas=2), engine("d")), keep=()
    )
    assert changes is not None
    assert changes.report() == "started d; restarted b; removed c; updated a (children kept)"


# -- building routes --------------------------------------------------------------


def test_a_static_upstream_becomes_a_plain_route_with_the_default_limit() -> None:
    """prepare turns an upstream into a route without a gate; the catalog's limit applies unless set."""
    catalog = Catalog(home=None, registry=None, max_in_flight=7)
    route = catalog.prepare(upstream("b", "http://10.0.0.7:8000/v1", aliases=("gpt",)))
    assert route == Route(
        model="b",
        upstream=UpstreamAddress("10.0.0.7", 8000),
        guards=specs.Guards(),
        max_in_flight=7,
        aliases=("gpt",),
    )
    own = catalog.prepare(upstream("b", max_in_flight=2))
    assert isinstance(own, Route) and own.max_in_flight == 2


def test_an_upstream_that_names_its_engine_gets_that_engine_s_guards() -> None:
    """engine beside upstream: no child, but the spec's request checks and non-stream handling apply."""
    spec = specs.load(MLX)
    route = Catalog(home=None, registry=None).prepare(upstream("r", engine=MLX))
    assert isinstance(route, Route) and route.gate is None
    assert route.guards == spec.guards and route.guards.via_stream


def test_allow_fields_opens_the_named_loading_fields_of_that_model_only() -> None:
    """allow-fields sets the route's allowed fields; the spec's guards stay as they were for others."""
    catalog = Catalog(home=None, registry=None)
    route = catalog.prepare(upstream("r", engine=MLX, allow_fields=("draft_model",)))
    assert isinstance(route, Route) and route.guards.allowed == frozenset({"draft_model"})
    assert specs.load(MLX).guards.allowed == frozenset()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"engine": MLX, "allow_fields": ("temperature",)}, "'temperature' is not a field that makes"),
        ({"engine": "llamacpp-b11434", "allow_fields": ("adapters",)}, "those are: none"),
        ({"allow_fields": ("adapters",)}, "only for a model whose engine is named"),
    ],
)
def test_allow_fields_names_only_fields_that_load_something(settings: dict[str, Any], message: str) -> None:
    """A field that loads nothing, an engine with none, or no engine at all: a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=message) as info:
        Catalog(home=None, registry=None).prepare(upstream("r", **settings))
    assert "[models.r] allow-fields" in str(info.value)


def test_build_refuses_a_name_two_models_would_serve() -> None:
    """An alias equal to another model's name fails the build, naming both places."""
    catalog = Catalog(home=None, registry=None)
    with pytest.raises(ConfigError, match=r"\[models.b\]: model name 'a' is already used by .*\[models.a\]"):
        catalog.build([upstream("a"), upstream("b", aliases=("a",))])


def prepared(tmp_path: Path, name: str, child_name: str, replicas: int = 1, **settings: Any) -> _Prepared:
    """An engine model as ``prepare`` leaves it, planned by hand: nothing installed, nothing started."""
    planned = tuple(
        PlannedChild(
            child_config(
                tmp_path, name=f"{child_name}-{i}" if replicas > 1 else child_name, served_model=name
            ),
            MLX,
            "cpu",
            tmp_path / "venv",
            None,
        )
        for i in range(replicas)
    )
    return _Prepared(
        engine(name, replicas=replicas, **settings),
        name,
        specs.load(MLX),
        planned,
        vocab_size=259,
        context_length=32768,
    )


def test_an_engine_model_becomes_a_gated_route_over_its_replicas(tmp_path: Path) -> None:
    """assemble makes one child per replica, a ServedModel kept by the registry, and the spec's guards
    with the model's vocabulary size and context length."""
    registry = Registry()
    catalog = Catalog(home=None, registry=registry)
    spec = specs.load(MLX)
    route = catalog.assemble(prepared(tmp_path, "m", "mlx--m", replicas=2, ttl_s=9.0))
    served = route.gate
    assert isinstance(served, ServedModel)
    assert served.keeper is registry and served.lifecycle is ModelState.UNLOADED
    assert served.lifetime == Lifetime(ttl_s=9.0)
    assert [r.gate for r in route.replicas] == list(served.children)
    assert all(c.state is ChildState.STOPPED for c in served.children)
    assert [r.upstream.port for r in route.replicas] == [c.config.port for c in served.children]
    # The engines generate batch_size each at once: more would only queue inside them.
    assert route.max_in_flight == spec.batch_size * 2
    # The spec's guards, with the model's vocabulary and context for the bounds that name them.
    assert route.guards == dataclasses.replace(spec.guards, vocab_size=259, context_length=32768)
    assert route.guards.via_stream


@pytest.mark.parametrize(("engine_args", "slots"), [((), None), (("--parallel", "8"), 8), (("-np", "3"), 3)])
def test_a_llamacpp_route_admits_as_many_as_its_children_have_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_args: tuple[str, ...], slots: int | None
) -> None:
    """max_in_flight is the slots (--parallel in engine-args, else the cores' default) times the replicas,
    and the route scrapes the spec's metrics path."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    spec = specs.load("llamacpp-b11434")
    assert spec.slots is not None
    base = prepared(tmp_path, "m", "llamacpp--m", replicas=2)
    config = dataclasses.replace(base.config, engine=spec.name, engine_args=engine_args)
    route = Catalog(home=None, registry=None).assemble(dataclasses.replace(base, config=config, spec=spec))
    assert route.max_in_flight == (slots or spec.slots.default(2)) * 2
    assert route.metrics_path == "/metrics"


def test_a_route_s_own_max_in_flight_wins_over_the_slots(tmp_path: Path) -> None:
    """A model's max-in-flight is kept whatever its --parallel; mlx's route scrapes nothing."""
    spec = specs.load("llamacpp-b11434")
    base = prepared(tmp_path, "m", "llamacpp--m", max_in_flight=5)
    config = dataclasses.replace(base.config, engine=spec.name, engine_args=("--parallel", "8"))
    route = Catalog(home=None, registry=None).assemble(dataclasses.replace(base, config=config, spec=spec))
    assert route.max_in_flight == 5
    assert Catalog(home=None, registry=None).assemble(prepared(tmp_path, "n", "mlx--n")).metrics_path == ""


def test_two_models_never_share_a_child_name_and_its_log(tmp_path: Path) -> None:
    """A second model planned onto a running model's child name is refused, naming both."""
    catalog = Catalog(home=None, registry=None)
    first = catalog.assemble(prepared(tmp_path, "a", "mlx--same"))
    catalog.entries["a"] = (engine("a"), first)
    shared = r"would share the child name 'mlx--same' \(and its log\) with model 'a'"
    with pytest.raises(ConfigError, match=shared):
        catalog.assemble(prepared(tmp_path, "b", "mlx--same"))


# -- checks made before any install -------------------------------------------------


def test_check_names_an_unknown_engine_where_it_was_given() -> None:
    """An engine version without a spec fails the check, with the file and key."""
    bad = dataclasses.replace(engine("a"), engine="mlx-9.9.9")
    with pytest.raises(ConfigError, match=r"^/etc/blazar.toml: \[models.a\] engine: "):
        Catalog(home=None, registry=None).check([bad])


def test_check_refuses_engine_arguments_that_override_the_gateway_s_own() -> None:
    """--port in engine-args would move the child from the port the gateway planned."""
    bad = dataclasses.replace(engine("a"), engine_args=("--port", "9"))
    with pytest.raises(ConfigError, match=r"\[models.a\] engine-args: engine argument '--port'"):
        Catalog(home=None, registry=None).check([bad])


def test_check_refuses_a_hub_model_under_another_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub repo is served under its repo id: a table named otherwise is told how to keep its name."""
    monkeypatch.chdir(tmp_path)  # no local directory named like the repo's org
    hub = ModelConfig(name="mine", engine=MLX, model="org/repo", source=f"{FILE}: [models.mine]")
    with pytest.raises(
        ConfigError, match=r'name the table \[models."org/repo"\] \(with aliases = \["mine"\]'
    ):
        Catalog(home=None, registry=None).check([hub])


# -- a reload applied ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_reload_that_only_retunes_asks_the_registry_and_keeps_the_model(tmp_path: Path) -> None:
    """A TTL, alias and allow-fields change: the same ServedModel, its lifetime changed by asking,
    the route updated."""
    lines: list[str] = []
    registry = Registry(announce=lines.append)
    catalog = Catalog(home=None, registry=registry, announce=lines.append)
    route = catalog.assemble(prepared(tmp_path, "m", "mlx--m"))
    catalog.entries["m"] = (engine("m"), route)
    served = route.gate
    assert isinstance(served, ServedModel)
    registry.add(served)
    relay = Relay(RoutingTable([route]), Settings())
    retuned = engine("m", ttl_s=30.0, aliases=("gpt",), allow_fields=("adapters",))
    await catalog.reload(file(retuned), keep=(), relay=relay)
    assert lines[-1] == "reload: updated m (children kept)"
    config, now = catalog.entries["m"]
    assert config == retuned and now.gate is served and now.aliases == ("gpt",)
    assert served.lifetime == Lifetime(ttl_s=30.0)
    assert registry.models["m"] is served and served.lifecycle is ModelState.UNLOADED
    assert relay.table.get("gpt") is now
    assert now.guards.allowed == frozenset({"adapters"})  # allow-fields applies in place


@pytest.mark.anyio
async def test_a_reload_of_static_upstreams_swaps_the_relay_s_table(tmp_path: Path) -> None:
    """Added and removed upstreams: the relay serves the new table, the catalog holds the new entries."""
    lines: list[str] = []
    catalog = Catalog(home=None, registry=Registry(), announce=lines.append)
    catalog.build([upstream("a"), upstream("b")])
    relay = Relay(RoutingTable(route for _, route in catalog.entries.values()), Settings())
    kept = catalog.entries["a"][1]
    await catalog.reload(file(upstream("a"), upstream("c", "http://127.0.0.1:9003")), keep=(), relay=relay)
    assert lines[-1] == "reload: started c; removed b"
    assert list(catalog.entries) == ["a", "c"]
    assert relay.table.get("a") is kept, "an unchanged route keeps its object (its queue and pools)"
    assert relay.table.get("b") is None and relay.table.get("c") is not None


@pytest.mark.anyio
async def test_a_reload_that_fails_changes_nothing(tmp_path: Path) -> None:
    """A bad URL in the file: ConfigError, and the running entries and table stay as they were."""
    catalog = Catalog(home=None, registry=Registry())
    catalog.build([upstream("a")])
    before = dict(catalog.entries)
    relay = Relay(RoutingTable(route for _, route in catalog.entries.values()), Settings())
    table = relay.table
    with pytest.raises(ConfigError, match=r"\[models.b\]"):
        await catalog.reload(file(upstream("a"), upstream("b", "ftp://x")), keep=(), relay=relay)
    assert catalog.entries == before and relay.table is table


def test_a_list_of_upstream_urls_is_one_route_with_a_replica_each() -> None:
    """upstream = [A, B] (or --upstream NAME=A --upstream NAME=B): one route, a gateless replica per URL."""
    config = ModelConfig(
        name="m",
        upstream="http://10.0.0.1:8000/v1",
        upstreams=("http://10.0.0.1:8000/v1", "http://10.0.0.2:8000"),
        engine=MLX,
    )
    route = Catalog(home=None, registry=None).prepare(config)
    assert isinstance(route, Route) and route.gate is None
    assert [r.upstream for r in route.all_replicas] == [
        UpstreamAddress("10.0.0.1", 8000),
        UpstreamAddress("10.0.0.2", 8000),
    ]
    assert all(r.gate is None for r in route.all_replicas)
    # engine beside the set applies to every server of it: one route, one set of guards.
    assert route.guards == specs.load(MLX).guards


def test_max_tokens_and_native_apis_reach_the_route_of_a_static_upstream() -> None:
    """A static upstream's max-tokens and native-apis are its route's guards; none given, none set."""
    catalog = Catalog(home=None, registry=None)
    route = catalog.prepare(upstream("r", max_tokens=256, native_apis=("messages", "responses")))
    assert isinstance(route, Route)
    assert route.guards.max_tokens == 256
    assert route.guards.native_apis == ("messages", "responses")
    plain = catalog.prepare(upstream("p"))
    assert isinstance(plain, Route) and plain.guards.max_tokens is None and plain.guards.native_apis == ()


def test_native_apis_of_a_model_override_its_engines() -> None:
    """An upstream running a named engine takes the spec's native APIs unless its config names its own."""
    catalog = Catalog(home=None, registry=None)
    route = catalog.prepare(upstream("r", engine=MLX))
    assert isinstance(route, Route) and route.guards.native_apis == specs.load(MLX).guards.native_apis == ()
    route = catalog.prepare(upstream("r", engine=MLX, native_apis=("responses",)))
    assert isinstance(route, Route) and route.guards.native_apis == ("responses",)
