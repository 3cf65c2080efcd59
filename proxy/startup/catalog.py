"""The catalog: model settings turned into routes, and configuration reloads applied.

Part of the composition root (with ``cli``): the one place besides it that
meets both ``engines`` (children, the registry) and ``proxy`` (routes, the
relay). An engine model becomes a ``ServedModel`` with one child per replica,
each on its own port; a static upstream becomes a plain route.

A reload reads the file again and compares each model's settings with the
running ones (``plan_reload``, a pure function). Unchanged models keep their
route object, so the relay keeps their queues, pools and requests in flight;
models whose children's settings are unchanged keep their children and are
retuned (aliases, limits, lifetime, asked of the registry); changed and new
ones are built (installing engines off the event loop); changed and removed
ones are retired once their requests in flight end. A file with an error
changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engines import builtin
from engines import install as installing
from engines import spec as specs
from engines.child import Child
from engines.environment import ServedNameError
from engines.formats import FormatError, check_model, context_length, describe, pick_engine, vocab_size
from engines.home import Home
from engines.plan import PlanError, PlannedChild, check_engine_args, free_port, plan
from engines.registry import Registry
from engines.served import Lifetime, ServedModel
from engines.spec import EngineSpec
from proxy.relay import Relay
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress, UpstreamSpecError, parse_upstream_url
from proxy.startup.configfile import ConfigError, FileConfig, ModelConfig, check_names
from proxy.startup.settings import variables
from proxy.status import Status

log = logging.getLogger("blazar.catalog")

# The guards of a route with no engine named: the spec's defaults (OpenAI's own limits).
NO_ENGINE = specs.Guards()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An engine model planned (installed, ports picked) but not yet in the event loop."""

    config: ModelConfig
    name: str
    spec: EngineSpec
    planned: tuple[PlannedChild, ...]
    # The model's vocabulary size where its files say (an MLX directory), for the token-id check.
    vocab_size: int | None = None
    # Its context length where its files say, for the max_tokens check.
    context_length: int | None = None


class Catalog:
    """The models this gateway serves, by their settings."""

    def __init__(
        self,
        *,
        home: Home | None,
        registry: Registry | None,
        max_in_flight: int | None = None,
        announce: Callable[[str], None] = log.info,
        status: Status | None = None,
    ) -> None:
        self.home = home
        # Told of each engine model's and child's change and of each line a child writes.
        self.status = status
        self.registry = registry
        self.max_in_flight = max_in_flight
        self.announce = announce
        # Model name → (its settings, its route), in the order configured.
        self.entries: dict[str, tuple[ModelConfig, Route]] = {}
        # Engine model name → requests its children generate at once (the default limit).
        self._batch: dict[str, int] = {}
        # Ports given to children so far: free until those children start, so never given twice.
        self._ports: set[int] = set()
        # Child name → the model it serves.
        self._child_owners: dict[str, str] = {}
        # The gateway's settings (its API keys among them) are none of a child's business.
        self._withheld_env = variables()

    # -- building -------------------------------------------------------------

    def prepare(self, config: ModelConfig) -> _Prepared | Route:
        """Everything that may block (install, demo model, planning); no event loop needed."""
        if config.upstream is not None:
            assert config.name is not None
            route = Route(
                model=config.name,
                upstream=parse_upstream_url(config.upstream),
                guards=NO_ENGINE,
                aliases=config.aliases,
            )
            if config.upstreams:
                # A replica set: one model, several servers; engine (below) applies to each.
                replicas = tuple(Replica(parse_upstream_url(url)) for url in config.upstreams)
                route = dataclasses.replace(route, replicas=replicas)
            if config.engine is not None:
                # An engine on another host: nothing to install or start, but
                # the same checks and non-stream handling as for a child.
                route = dataclasses.replace(route, guards=guards_of(specs.load(config.engine).guards, config))
            elif config.allow_fields:
                raise ConfigError(
                    f"{config.where('allow-fields')}: only for a model whose engine is named "
                    "(the engine's spec says which fields load something)"
                )
            else:
                route = dataclasses.replace(route, guards=guards_of(NO_ENGINE, config))
            return dataclasses.replace(route, max_in_flight=config.max_in_flight or self.max_in_flight)
        return self._plan_engine(config)

    def _plan_engine(self, config: ModelConfig) -> _Prepared:
        assert self.home is not None and config.engine is not None
        engine = config.engine
        # Before any install: an unknown builtin: name fails at once.
        chosen = builtin.parse(config.model)
        if engine == "auto":
            if config.model is None:
                raise ConfigError(
                    'engine "auto" needs a model: the engine is picked by its format; give --model PATH, '
                    f"or name an engine for its built-in model ({', '.join(specs.available())})"
                )
            if chosen is not None:
                raise ConfigError(
                    f'engine "auto" picks the engine from a model\'s format; {config.model} is made for '
                    "the engine: name the engine"
                )
            model_path = Path(config.model).expanduser()
            engine = pick_engine(model_path)
            self.announce(
                f"engine auto for {config.name or config.model!r}: {describe(model_path)}: {engine}"
            )
        spec, installation = installing.ensure_installed(
            engine, config.variant, self.home, progress=self.announce
        )
        model, served_name = config.model, config.name
        if chosen is not None:
            if model is None:
                self.announce(
                    f"no model given for {engine}: serving the built-in model {builtin.PREFIX}{chosen}, "
                    f"{builtin.BUILTINS[chosen].summary}"
                )
            model = str(builtin.ensure_builtin(chosen, installation, self.home, progress=self.announce))
            served_name = served_name or builtin.served_name(chosen, installation)
        assert model is not None  # no model is the default built-in one
        planned = []
        for index in range(config.replicas):
            one = plan(
                spec,
                installation,
                self.home,
                model=model,
                served_name=served_name,
                port=self._port(free_port),
                extra_args=config.engine_args,
                withheld_env=self._withheld_env,
            )
            child = one.config
            name = child.name if config.replicas == 1 else f"{child.name}-{index}"
            child = dataclasses.replace(child, name=name, log_path=child.log_path.with_name(f"{name}.log"))
            planned.append(dataclasses.replace(one, config=child))
        return _Prepared(
            config,
            planned[0].config.served_model,
            spec,
            tuple(planned),
            vocab_size=vocab_size(model),
            context_length=context_length(model),
        )

    def _port(self, free_port: Callable[..., int]) -> int:
        port = free_port(exclude=self._ports)
        self._ports.add(port)
        return port

    def assemble(self, prepared: _Prepared | Route) -> Route:
        """Make the children and the route, in the event loop's thread."""
        if isinstance(prepared, Route):
            return prepared
        config, spec = prepared.config, prepared.spec
        first = prepared.planned[0]
        for planned in prepared.planned:
            # Child names name log files: two models must never share one.
            owner = self._child_owners.setdefault(planned.config.name, prepared.name)
            if owner != prepared.name and owner in self.entries:
                raise ConfigError(
                    f"{config.source or prepared.name}: model {prepared.name!r} would share the child name "
                    f"{planned.config.name!r} (and its log) with model {owner!r}; rename one of them"
                )
            self._child_owners[planned.config.name] = prepared.name
        children = [Child(p.config, on_ready=self._on_ready(p)) for p in prepared.planned]
        served = ServedModel(
            prepared.name,
            children,
            Lifetime(always_loaded=config.always_loaded, ttl_s=config.ttl_s),
            keeper=self.registry,
            description=f"{first.engine} ({first.variant}), {len(children)} replica(s)",
            engine=first.engine,
            variant=first.variant,
        )
        if self.status is not None:
            served.on_change = self.status.changed
            for child in children:
                child.observe(self.status.changed, functools.partial(self.status.log_line, child.config.name))
        batch = spec.slots_for(config.engine_args) * len(children)
        self._batch[prepared.name] = batch
        return Route(
            model=prepared.name,
            upstream=UpstreamAddress(first.config.host, first.config.port),
            gate=served,
            guards=guards_of(
                dataclasses.replace(
                    spec.guards, vocab_size=prepared.vocab_size, context_length=prepared.context_length
                ),
                config,
            ),
            metrics_path=spec.metrics_path,
            # The engines generate this many at once; more would only queue inside them.
            max_in_flight=config.max_in_flight or self.max_in_flight or batch,
            aliases=config.aliases,
            replicas=tuple(
                Replica(UpstreamAddress(p.config.host, p.config.port), child)
                for p, child in zip(prepared.planned, children, strict=True)
            ),
        )

    def _on_ready(self, planned: PlannedChild) -> Callable[[Child], None]:
        def announce(child: Child) -> None:
            self.announce(
                f"engine {planned.engine} ({planned.variant}) serving {child.config.served_model!r}: "
                f"venv {planned.venv}, CUDA_HOME {planned.cuda_home or '-'}, pid {child.pid}, "
                f"port {child.config.port}, ready in {child.ready_in_s:.1f} s"
            )

        return announce

    def check(self, configs: Sequence[ModelConfig]) -> None:
        """Check what needs no install, for every model before any is built; or a ``ConfigError``.

        Each engine model's engine, variant and engine arguments (from its
        spec, which is data), and its model: a path that exists, in a format
        the engine serves, or a hub repo id for an engine that downloads.
        """
        for config in configs:
            if config.upstream is not None and config.engine is not None:
                _check_upstream_engine(config)
            elif config.engine is not None:
                _check_engine_model(config)

    def build(self, configs: Sequence[ModelConfig]) -> None:
        """At startup, before the event loop, after ``check``: every model, or a ``ConfigError``."""
        sources: dict[str, str] = {}
        for config in configs:
            route = self.assemble(self._prepare_checked(config))
            source = config.source or f"model {route.model!r}"
            for name in (route.model, *route.aliases):
                if name in sources:
                    raise ConfigError(f"{source}: model name {name!r} is already used by {sources[name]}")
                sources[name] = source
            self.entries[route.model] = (config, route)

    def _prepare_checked(self, config: ModelConfig) -> _Prepared | Route:
        where = config.source or (f"model {config.name!r}" if config.name else "the --engine model")
        try:
            return self.prepare(config)
        except (
            specs.SpecError,
            installing.InstallError,
            PlanError,
            ServedNameError,
            UpstreamSpecError,
        ) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except ValueError as exc:  # engines.formats: not a model it recognises
            raise ConfigError(f"{where}: {exc}") from None

    def served_models(self) -> list[ServedModel]:
        # An engine route's gate is the ServedModel that assemble made.
        return [route.gate for _, route in self.entries.values() if isinstance(route.gate, ServedModel)]

    # -- reloading ------------------------------------------------------------

    async def reload(self, file: FileConfig, keep: Sequence[str], relay: Relay) -> None:
        """Apply the file's models; ``keep`` names models from the command line, left alone.

        Raises ``ConfigError`` and changes nothing when a model cannot be built.
        """
        changes = plan_reload({name: config for name, (config, _) in self.entries.items()}, file, keep)
        if changes is None:
            self.announce(f"reload: {file.path}: no model changed")
            return
        self.check(changes.rebuilt)
        # Installing and planning may take a while: off the event loop.
        prepared = [await asyncio.to_thread(self._prepare_checked, c) for c in changes.rebuilt]
        entries = dict(self.entries)
        for name in changes.removed:
            del entries[name]
        new_routes = []
        for config, item in zip(changes.rebuilt, prepared, strict=True):
            route = self.assemble(item)
            entries[route.model] = (config, route)
            new_routes.append(route)
        for config in changes.retuned:
            assert config.name is not None
            route = self.entries[config.name][1]
            assert isinstance(route.guards, specs.Guards)  # the catalog's routes carry a spec's
            limit = config.max_in_flight or self.max_in_flight or self._batch[config.name]
            entries[config.name] = (
                config,
                dataclasses.replace(
                    route,
                    aliases=config.aliases,
                    max_in_flight=limit,
                    guards=guards_of(route.guards, config),
                ),
            )
        try:
            table = RoutingTable(route for _, route in entries.values())
        except UpstreamSpecError as exc:
            raise ConfigError(f"{file.path}: {exc}") from None
        old = [self.entries[name][1] for name in (*changes.removed, *changes.replaced)]
        self.entries = entries
        relay.update(table)
        if self.registry is not None:
            for config in changes.retuned:
                assert config.name is not None
                # The model's lifetime is its own: the registry asks it to take the new one.
                served = entries[config.name][1].gate
                assert isinstance(served, ServedModel)
                self.registry.retune(served, Lifetime(always_loaded=config.always_loaded, ttl_s=config.ttl_s))
            await self.registry.replace(
                added=[r.gate for r in new_routes if isinstance(r.gate, ServedModel)],
                removed=[r.model for r in old if r.gate is not None],
            )
        self.announce(f"reload: {changes.report()}")


def guards_of(guards: specs.Guards, config: ModelConfig) -> specs.Guards:
    """The engine's guards with what the model's config sets (the fields it allows, its max-tokens,
    its native APIs); a ``ConfigError`` for a field that is not one that loads something."""
    loads = sorted(f.name for f in guards.fields if f.loads)
    for name in config.allow_fields:
        if name not in loads:
            raise ConfigError(
                f"{config.where('allow-fields')}: {name!r} is not a field that makes this engine load "
                f"something; those are: {', '.join(loads) or 'none'}"
            )
    return dataclasses.replace(
        guards,
        allowed=frozenset(config.allow_fields),
        max_tokens=config.max_tokens,
        native_apis=guards.native_apis if config.native_apis is None else config.native_apis,
    )


def _check_upstream_engine(config: ModelConfig) -> None:
    assert config.engine is not None
    try:
        specs.load(config.engine)
    except specs.SpecError as exc:
        raise ConfigError(f"{config.where('engine')}: {exc}") from None


def _check_engine_model(config: ModelConfig) -> None:
    assert config.engine is not None
    spec = None
    if config.engine != "auto":
        try:
            spec = specs.load(config.engine)
        except specs.SpecError as exc:
            raise ConfigError(f"{config.where('engine')}: {exc}") from None
        if config.variant != "auto":
            try:
                spec.packages_for(config.variant)
            except specs.SpecError as exc:
                raise ConfigError(f"{config.where('variant')}: {exc}") from None
        try:
            check_engine_args(spec, config.engine_args)
        except PlanError as exc:
            raise ConfigError(f"{config.where('engine-args')}: {exc}") from None
    model = config.model
    try:
        if builtin.parse(model) is not None:
            return  # a model the gateway makes itself
    except builtin.BuiltinError as exc:
        raise ConfigError(f"{config.where('model')}: {exc}") from None
    assert model is not None  # None is the default built-in model
    try:
        kind = check_model(model, spec)
    except FormatError as exc:
        raise ConfigError(f"{config.where('model')}: {exc}") from None
    if kind == "hub" and config.name is not None and config.name != model:
        # The child downloads the repo and answers to its id only (engines.plan.plan).
        if config.source.startswith("--engine"):
            raise ConfigError(
                f"--served-name {config.name}: a hub model is served under its repo id {model!r}; "
                "to serve it under another name, download it and give its directory to --model"
            )
        raise ConfigError(
            f"{config.source}: a hub model is served under its repo id {model!r}, not {config.name!r}: "
            f'name the table [models."{model}"] (with aliases = ["{config.name}"] to keep this name), '
            "or download it and give its directory as model"
        )


# What decides a model's children: a change to any of these restarts them.
_CHILD_SETTINGS = ("engine", "model", "upstream", "replicas", "engine_args", "variant")


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes, by model name, decided before anything is built."""

    # New models, and models whose children change: built, then started or restarted.
    rebuilt: tuple[ModelConfig, ...] = ()
    # Engine models whose aliases, limits or lifetime changed: their children keep running.
    retuned: tuple[ModelConfig, ...] = ()
    # Running models the file no longer names.
    removed: tuple[str, ...] = ()
    # The rebuilt models that were running (the others are new).
    replaced: tuple[str, ...] = ()
    # Of those, the static upstreams, before and after: their route is rebuilt, nothing restarts.
    rerouted: tuple[str, ...] = ()

    def report(self) -> str:
        """The reload's line in the gateway's output."""
        started = [str(c.name) for c in self.rebuilt if c.name not in self.replaced]
        restarted = [name for name in self.replaced if name not in self.rerouted]
        parts = [
            f"started {', '.join(started)}" if started else "",
            f"restarted {', '.join(restarted)}" if restarted else "",
            f"removed {', '.join(self.removed)}" if self.removed else "",
            f"updated {', '.join(self.rerouted)} (static upstream)" if self.rerouted else "",
            f"updated {', '.join(str(c.name) for c in self.retuned)} (children kept)" if self.retuned else "",
        ]
        return "; ".join(part for part in parts if part)


def plan_reload(
    running: Mapping[str, ModelConfig], file: FileConfig, keep: Collection[str]
) -> ReloadPlan | None:
    """Compare the file's models with the running ones; None when no model changed.

    ``running``: each served model's settings, in the order configured;
    ``keep``: the models from the command line, which a reload leaves alone.
    Raises ``ConfigError`` for a file that must not be applied: a name given
    twice, a name the command line already serves, or no model at all.
    """
    check_names(file.models, str(file.path))
    wanted = {c.name: c for c in file.models if c.name is not None}
    clash = set(wanted) & set(keep)
    if clash:
        raise ConfigError(f"{file.path}: model {sorted(clash)[0]!r} is also given on the command line")
    if not wanted and not keep:
        # An editor that truncates before writing would otherwise stop every model.
        raise ConfigError(f"{file.path}: names no models, and nothing else would be served; not applied")
    changed = [c for name, c in wanted.items() if running.get(name) != c]
    retuned = tuple(
        c for c in changed if c.name is not None and c.name in running and _same_children(running[c.name], c)
    )
    rebuilt = tuple(c for c in changed if c not in retuned)
    removed = tuple(name for name in running if name not in keep and name not in wanted)
    if not changed and not removed:
        return None
    replaced = tuple(c.name for c in rebuilt if c.name is not None and c.name in running)
    rerouted = tuple(
        name for name in replaced if running[name].upstream is not None and wanted[name].upstream is not None
    )
    return ReloadPlan(rebuilt=rebuilt, retuned=retuned, removed=removed, replaced=replaced, rerouted=rerouted)


def _same_children(running: ModelConfig, config: ModelConfig) -> bool:
    """Whether ``config`` keeps ``running``'s children: an engine model, the same child settings."""
    return running.upstream is None and all(
        getattr(running, k) == getattr(config, k) for k in _CHILD_SETTINGS
    )
