"""The ``blazar-proxy`` command: parse flags (and BLAZAR_* variables), then serve.

This is the composition root: the one place that wires ``engines`` (children)
and ``proxy`` (the request path) together.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import difflib
import errno
import ipaddress
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click
import orjson
import uvicorn

from engines import install as installing
from engines import spec as specs
from engines.home import Home, blazar_home
from engines.registry import Registry
from proxy import __version__, compiled
from proxy.accesslog import AccessLog
from proxy.app import Gateway, build_app
from proxy.auth import ApiKeys, read_key_file
from proxy.browser import AllowedHosts
from proxy.cors import Cors
from proxy.lean import server_protocol
from proxy.metrics import Metrics
from proxy.routing import RoutingTable, UpstreamAddress, UpstreamSpecError, parse_upstream_spec
from proxy.startup import configfile
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import ConfigError, FileConfig, ModelConfig
from proxy.startup.options import gateway_options, given_as, settings_from
from proxy.startup.reload import Reloader
from proxy.startup.server import GatewayServer
from proxy.startup.settings import Settings, flags
from proxy.startup.status import child_logs, engine_samples, engine_view
from proxy.status import Status

log = logging.getLogger("blazar.cli")

# prctl(2): whether the process may be dumped, and so read (its /proc/<pid>/environ) or traced by its user.
_PR_SET_DUMPABLE = 4


def _echo(line: str) -> None:
    click.echo(f"blazar-proxy: {line}", err=True)


class _Failed(click.ClickException):
    """An error that ends the command: one line, prefixed like the gateway's others; exit code 1."""

    def show(self, file: Any = None) -> None:
        _echo(self.format_message())


class _AffinitySlack(click.ParamType[int | None]):
    """``--affinity-slack``: an integer of at least 0, or ``off`` (None)."""

    name = "N|off"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                self.fail(f"{value} is below 0", param, ctx)
            return value
        text = str(value).strip().lower()
        if text == "off":
            return None
        try:
            slack = int(text)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number of requests nor off", param, ctx)
        if slack < 0:
            self.fail(f"{slack} is below 0", param, ctx)
        return slack


_EXIT_CODES = """\b
Exit codes: 0 stopped by SIGTERM or SIGINT (after the drain); 1 an error at
start (a bad value, config file, model or port; an engine that failed to
install or to become ready); 2 a usage error; 130 interrupted before
serving, or a third signal."""


@click.group(invoke_without_command=True, context_settings={"show_default": True}, epilog=_EXIT_CODES)
@gateway_options(
    {"config_file": {"is_eager": True, "callback": lambda ctx, param, value: _read_config(ctx, value)}}
)
@click.version_option(__version__, prog_name="blazar-proxy")
@click.pass_context
def main(ctx: click.Context, /, **given: Any) -> None:
    """An OpenAI-compatible gateway in front of local LLM engine servers.

    Clients send OpenAI API requests to this gateway; each goes to the
    upstream that serves the request's `model`, and the response bytes come
    back as they arrive. `blazar-proxy --engine mlx-0.32.0` alone installs
    the engine, starts it with a small real model (SmolLM2-135M-Instruct) and
    serves it.

    Engines, models and child logs live in BLAZAR_HOME (default
    $XDG_DATA_HOME/blazar, i.e. ~/.local/share/blazar).
    """
    if ctx.invoked_subcommand is not None:
        return
    settings = settings_from(given)
    configs = _model_configs(settings)
    _check_allowed_hosts(ctx, settings)
    from_command_line = len(configs)
    file = settings.config_file
    configs.extend(file.models if file else ())
    # Always there, even for static upstreams only: a reload may add an engine model.
    registry = Registry(
        max_loaded=settings.max_loaded, announce=_echo, unload_wait_s=settings.drain_timeout_s
    )
    # What the gateway is doing (the status page, /v1/models, /metrics): told of each engine change.
    status = Status()
    catalog = Catalog(
        home=Home(blazar_home()),
        registry=registry,
        max_in_flight=settings.max_in_flight,
        announce=_echo,
        status=status,
    )
    _build_catalog(ctx, catalog, configs, settings)
    keep = list(catalog.entries)[:from_command_line]
    for served in catalog.served_models():
        registry.add(served)
    if settings.max_loaded and not catalog.served_models():
        _echo("--max-loaded applies to engine models; none are configured yet")
    settings = dataclasses.replace(
        settings,
        routes=tuple(route for _, route in catalog.entries.values()),
        api_keys=(
            *settings.api_keys,
            *(read_key_file(settings.api_key_file) if settings.api_key_file else ()),
        ),
    )
    reloader = (
        Reloader(
            file,
            catalog,
            keep,
            read_option=lambda key, value: _gateway_option(ctx, key, value),
            announce=_echo,
            watch=settings.watch_config,
        )
        if file
        else None
    )
    serve(settings, registry=registry, reloader=reloader, status=status)


def _model_configs(settings: Settings) -> list[ModelConfig]:
    """The models the command line names (--upstream, --engine); a usage error if there are none at all."""
    file_models = settings.config_file.models if settings.config_file else ()
    if not settings.upstreams and not settings.engine and not file_models:
        raise click.UsageError(
            "nothing to serve: give --engine ENGINE [--model PATH], --upstream NAME=URL, "
            "or --config FILE with [models.NAME] tables"
        )
    if (settings.model or settings.served_name) and not settings.engine:
        raise click.UsageError("--model and --served-name need --engine")
    configs = []
    # One NAME given several times is one model served by a set of servers.
    sets: dict[str, list[str]] = {}
    for spec in settings.upstreams:
        try:
            name, _ = parse_upstream_spec(spec)
        except UpstreamSpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--upstream") from None
        urls = sets.setdefault(name, [])
        url = spec.partition("=")[2].strip()
        if url in urls:
            raise click.BadParameter(
                f"{spec}: this server is already given for {name}", param_hint="--upstream"
            )
        urls.append(url)
    for name, urls in sets.items():
        source = " ".join(f"--upstream {name}={url}" for url in urls)
        configs.append(
            ModelConfig(
                name=name, upstream=urls[0], upstreams=tuple(urls) if len(urls) > 1 else (), source=source
            )
        )
    if settings.engine:
        # The one-line start: its model starts with the gateway.
        configs.append(
            ModelConfig(
                name=settings.served_name,
                engine=settings.engine,
                model=settings.model,
                variant=settings.engine_variant,
                always_loaded=True,
                source=f"--engine {settings.engine}",
            )
        )
    return configs


def _build_catalog(
    ctx: click.Context, catalog: Catalog, configs: list[ModelConfig], settings: Settings
) -> None:
    """Check every model, then the port, then install and plan: what is wrong is said before any install."""
    try:
        catalog.check(configs)
        # Before any engine is installed or started: a port in use would only show then.
        _check_listen(ctx, settings.host, settings.port)
        catalog.build(configs)
    except ConfigError as exc:
        raise _Failed(str(exc)) from None
    except KeyboardInterrupt:
        # Ctrl-C while an engine installs (the installer is killed) or a demo model is made.
        _echo("interrupted before the gateway started; no engine child was started")
        raise SystemExit(130) from None


@main.group()
def engines() -> None:
    """Install, list and remove engine versions (in $BLAZAR_HOME/engines; BLAZAR_HOME defaults to
    ~/.local/share/blazar)."""


@engines.command("install")
@click.argument("engine")
@click.option("--variant", type=click.Choice(specs.VARIANT_CHOICES), default="auto", show_default=True)
def engines_install(engine: str, variant: str) -> None:
    """Install ENGINE (e.g. mlx-0.32.0) into its own virtualenv."""

    try:
        installing.ensure_installed(engine, variant, Home(blazar_home()), progress=_echo)
    except (specs.SpecError, installing.InstallError) as exc:
        raise _Failed(str(exc)) from None
    except KeyboardInterrupt:
        _echo(f"interrupted; {engine} is not installed (the next install starts over)")
        raise SystemExit(130) from None


@engines.command("list")
def engines_list() -> None:
    """Show the engine versions that can be installed, and which are, with variant, size and path."""

    home = Home(blazar_home())
    found = {item.name: item for item in installing.installed(home)}
    click.echo(f"{'ENGINE':<16} {'VARIANTS':<26} {'INSTALLED':<24} SUMMARY")
    for name in sorted({*specs.available(), *found}):
        try:
            spec = specs.load(name)
            variants, summary = " ".join(spec.packages), spec.summary
        except specs.SpecError:
            variants, summary = "-", "(installed; its spec is no longer shipped)"
        item = found.get(name)
        state = "no"
        if item is not None:
            size_mb = installing.size_bytes(home.engine_dir(name)) / 1e6
            state = f"{item.variant}, {size_mb:.0f} MB"
        click.echo(f"{name:<16} {variants:<26} {state:<24} {summary}")
    click.echo(f"engines live in {home.root / 'engines'} (BLAZAR_HOME); install one with")
    click.echo("`blazar-proxy engines install ENGINE`, or just start it: `blazar-proxy --engine ENGINE`")


@engines.command("remove")
@click.argument("engine")
def engines_remove(engine: str) -> None:
    """Delete an installed ENGINE."""

    if not installing.remove(Home(blazar_home()), engine):
        raise _Failed(f"{engine} is not installed")
    click.echo(f"removed {engine}")


def serve(
    settings: Settings,
    *,
    registry: Registry | None = None,
    reloader: Reloader | None = None,
    status: Status | None = None,
) -> None:
    """Run the gateway until it is stopped."""
    _configure_logging(settings.log_level)
    _close_to_own_user()
    metrics = Metrics() if settings.metrics else None
    status = status or Status()
    status.metrics = metrics
    app: Gateway

    async def startup() -> None:
        if registry is not None:
            await registry.start(on_start_failed=server.fail)
        if reloader is not None:
            reloader.start(app.relay)

    async def shutdown() -> None:
        if reloader is not None:
            reloader.stop()
        if registry is not None:
            running = [
                (child.config.name, child.pid)
                for model in registry.models.values()
                for child in model.children
                if child.pid is not None
            ]
            await registry.shutdown()
            for name, pid in running:
                _echo(f"stopped engine child {name} (pid {pid})")

    app = build_app(
        RoutingTable(settings.routes),
        settings,
        on_startup=startup,
        on_shutdown=shutdown,
        api_keys=ApiKeys(settings.api_keys),
        metrics=metrics,
        cors=Cors(settings.cors_origins),
        hosts=AllowedHosts(settings.allowed_hosts, bound=settings.host, port=settings.port),
        access_log=AccessLog(settings.log_format, settings.forwarded_allow_ips)
        if settings.access_log
        else None,
        status=status,
        engine_view=engine_view,
    )
    relay = app.relay
    status.bind_logs(child_logs(lambda: relay.table))
    if metrics is not None:
        # The children as the page shows them: one snapshot for both.
        metrics.watch_engines(lambda: engine_samples(status.models()))
    config = _uvicorn_config(settings, app)
    on_hangup = reloader.reload_soon if reloader is not None else None
    announcing: set[asyncio.Task[None]] = set()

    def on_listening(bound: list[tuple[str, int]]) -> None:
        keyed = settings.strip_credentials
        if not keyed:
            _warn_open(bound)
        if compiled.STATE != "compiled":
            _echo(f"note: the request path runs {compiled.STATE}; compiled, it takes about 40 % less CPU")
        task = asyncio.ensure_future(_announce_ready(bound, app.relay.table, registry, keyed=keyed))
        announcing.add(task)
        task.add_done_callback(announcing.discard)

    server = GatewayServer(
        config,
        app,
        settings.drain_timeout_s,
        on_hangup=on_hangup,
        on_force_exit=registry.kill_now if registry is not None else None,
        on_listening=on_listening,
    )
    _run(server, settings)


def _check_allowed_hosts(ctx: click.Context, settings: Settings) -> None:
    """Say what is wrong with --allowed-hosts before anything is installed."""
    try:
        AllowedHosts(settings.allowed_hosts)
    except ValueError as exc:
        raise _Failed(f"{_given_as(ctx, 'allowed_hosts')}: {exc}") from None


def _close_to_own_user() -> None:
    """Make the gateway non-dumpable (Linux): other processes of its user, its engine children
    among them, can no longer read its /proc/<pid>/environ (BLAZAR_API_KEY), mem or fds, nor
    trace it. It also writes no core dump, and py-spy or gdb attach only as root. A child's own
    exec makes it dumpable again: the engines are not affected."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        reason = errno.errorcode.get(ctypes.get_errno(), "?")
        _echo(
            f"warning: could not make the gateway non-dumpable ({reason}): other processes "
            "of its user can read its environment, BLAZAR_API_KEY included"
        )


def _warn_open(bound: list[tuple[str, int]]) -> None:
    """Say so when a gateway without an API key listens beyond this machine."""
    public = [(host, port) for host, port in bound if not ipaddress.ip_address(host).is_loopback]
    if not public:
        return
    where = ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in public)
    _echo(
        f"warning: listening on {where} without an API key: anyone who can reach this address can run "
        "generations, load and unload models and read /metrics. Require a key with --api-key KEY "
        "(or BLAZAR_API_KEY, or --api-key-file), or listen on this machine only with --host 127.0.0.1"
    )


def _uvicorn_config(settings: Settings, app: Gateway) -> uvicorn.Config:
    """uvicorn's settings: our protocol (head deadline, header limit), uvloop, no access log of its own."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=server_protocol(settings.header_timeout_s, settings.max_header_bytes, settings.body_timeout_s),
        ws="none",
        timeout_keep_alive=settings.keep_alive_timeout_s,
        lifespan="on",
        access_log=False,
        server_header=False,
        # The gateway does not use the client address; the middleware that
        # rewrites it from X-Forwarded-For would cost every request.
        proxy_headers=False,
        # A backstop after our own drain (server.py) has ended what it could.
        timeout_graceful_shutdown=10,
        log_level=settings.log_level,
    )


def _run(server: GatewayServer, settings: Settings) -> None:
    """Serve until stopped; a failure to start or a third signal becomes the exit code."""
    try:
        server.run()
    except SystemExit as exc:
        if exc.code != uvicorn.config.STARTUP_FAILURE:
            raise
        # uvicorn logged why just above (and stopped the children it had).
        lifespan = getattr(server, "lifespan", None)
        if lifespan is not None and getattr(lifespan, "startup_failed", False):
            _echo("stopped: the gateway's startup failed (the error is above)")
        else:
            _echo(
                f"stopped: cannot listen on {settings.host}:{settings.port} (the error is above); "
                "free it, or give another --port (BLAZAR_PORT, or port in the config file's [gateway])"
            )
        raise SystemExit(1) from None
    if server.force_exit:
        # A third signal: nothing was drained or stopped in order.
        raise SystemExit(130)
    if server.failure is not None:
        _echo(f"stopped: {server.failure}")
        raise SystemExit(1)


def _check_listen(ctx: click.Context, host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will, and let go: say now what would stop it listening."""
    if port == 0:
        return  # any free port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _Failed(
            f"{_given_as(ctx, 'host')} {host}: {exc.strerror}; give an address of this machine "
            "(127.0.0.1, or 0.0.0.0 for all)"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # As asyncio's create_server: a port left in TIME_WAIT is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise _Failed(_bind_error(exc, ctx, host, port)) from None


def _bind_error(exc: OSError, ctx: click.Context, host: str, port: int) -> str:
    """What keeps the gateway from binding, and which setting to change."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another blazar-proxy, or another server); "
            f"stop that one, or choose another port with {_given_as(ctx, 'port')}"
        )
    if exc.errno == errno.EACCES:
        return (
            f"port {port} on {host} needs privileges to bind (ports below 1024 do); "
            f"choose one from 1024 with {_given_as(ctx, 'port')}"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{host} is not an address of this machine; give one of its own (127.0.0.1, or 0.0.0.0 for "
            f"all) with {_given_as(ctx, 'host')}"
        )
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}; check {_given_as(ctx, 'host')} and --port"


def _given_as(ctx: click.Context, name: str) -> str:
    """How option ``name`` was set, to say which one to change: its flag, its variable or the file's key."""
    return given_as(ctx, next(p for p in ctx.command.params if p.name == name))


# The ready line waits this long for the always-loaded models (their readiness timeout is 600 s).
_ANNOUNCE_WAIT_S = 3600.0


async def _announce_ready(
    bound: list[tuple[str, int]], table: RoutingTable, registry: Registry | None, *, keyed: bool = False
) -> None:
    """Once the always-loaded models serve: the gateway's URL, its models, and a request to copy."""
    always = [m for m in registry.models.values() if m.lifetime.always_loaded] if registry else []
    ready = await asyncio.gather(*(model.wait_ready(_ANNOUNCE_WAIT_S) for model in always))
    if not all(ready) or not bound:
        return  # a model that cannot start says so itself
    host, port = bound[0]
    # A wildcard bind is reached here through the loopback address.
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    base = f"http://{shown}:{port}/v1"
    names = [route.model for route in table]
    first = always[0].name if always else (names[0] if names else "MODEL")
    _echo(f"ready: {base} serves {', '.join(names) or 'no models yet'}")
    body = orjson.dumps(
        {
            "model": first,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    ).decode()
    key = " -H 'authorization: Bearer YOUR_API_KEY'" if keyed else ""
    _echo(f"try it: curl -s {base}/chat/completions{key} -H 'content-type: application/json' -d '{body}'")
    _echo(f"status page: http://{shown}:{port}/ui" + (" (it asks for the API key once)" if keyed else ""))
    await _warn_unreachable(table)


# How long the start-up look at each --upstream server waits for a connection.
_PROBE_TIMEOUT_S = 2.0


async def _warn_unreachable(table: RoutingTable) -> None:
    """Say which servers named as upstreams refuse connections now (their requests get 503 until they
    answer): a ready line alone would promise a request that cannot work."""
    servers: dict[UpstreamAddress, str] = {}
    for route in table:
        if route.gate is None:
            for replica in route.all_replicas:
                if replica.gate is None:
                    servers.setdefault(replica.upstream, route.model)
    reasons = await asyncio.gather(*(_refusal(address) for address in servers))
    for (address, model), why in zip(servers.items(), reasons, strict=True):
        if why is not None:
            where = f"nothing answers at {address.base_url} ({model})"
            _echo(f"warning: {where}: {why}; its requests get 503 until it does")


async def _refusal(address: UpstreamAddress) -> str | None:
    """Why a connection to ``address`` cannot be opened now; None when it can."""
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), _PROBE_TIMEOUT_S
        )
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no connection within {_PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    writer.close()
    return None


# -- the configuration file ------------------------------------------------------

# Options that take a comma-separated list in one value: the file may give a TOML list.
_COMMA_LISTS = frozenset(name for name, flag in flags() if flag.commas)

# Options that name what to serve: in the file they are [models.NAME] tables.
_NOT_IN_GATEWAY_TABLE = frozenset(
    {"config_file", "upstreams", "engine", "model", "served_name", "engine_variant"}
)


def _read_config(ctx: click.Context, value: Path | None) -> FileConfig | None:
    """The --config callback (eager): read the file, and make its [gateway] table click's defaults."""
    if value is None or ctx.resilient_parsing:
        return None
    try:
        file = configfile.load(value, lambda key, item: _gateway_option(ctx, key, item))
    except ConfigError as exc:
        raise _Failed(str(exc)) from None
    ctx.default_map = {**(ctx.default_map or {}), **file.gateway}
    return file


def _gateway_option(ctx: click.Context, key: str, value: object) -> tuple[str, object]:
    """One [gateway] entry as (option name, value), checked by the option's own type."""
    wanted = key.replace("-", "_")
    options = [
        p
        for p in ctx.command.params
        if isinstance(p, click.Option) and p.name is not None and p.name not in ("help", "version")
    ]
    for param in options:
        longs = {opt.lstrip("-").replace("-", "_") for opt in param.opts if opt.startswith("--")}
        if wanted != param.name and wanted not in longs:
            continue
        if param.name in _NOT_IN_GATEWAY_TABLE:
            raise ValueError("not a gateway setting; models go in [models.NAME] tables")
        if param.multiple and not isinstance(value, list):
            value = [value]
        elif param.name in _COMMA_LISTS and isinstance(value, list):
            # A TOML list for a comma-separated option (forwarded-allow-ips = ["a", "b"]).
            if not all(isinstance(item, str) for item in value):
                raise ValueError("give a list of strings, or one string of comma-separated items")
            value = ",".join(value)
        try:
            param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise ValueError(exc.message) from None
        assert param.name is not None
        return param.name, value
    known = sorted(p.opts[0].lstrip("-") for p in options if p.name not in _NOT_IN_GATEWAY_TABLE)
    hint = difflib.get_close_matches(key, known, n=1)
    raise ValueError("not a gateway setting" + (f" (did you mean {hint[0]!r}?)" if hint else ""))


def _configure_logging(level: str) -> None:
    access = logging.getLogger("blazar.access")
    if not access.handlers:
        plain = logging.StreamHandler(sys.stderr)
        plain.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(plain)
    # The access log is on or off by its own flag, whatever the log level.
    access.setLevel(logging.INFO)
    access.propagate = False
    logger = logging.getLogger("blazar")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
