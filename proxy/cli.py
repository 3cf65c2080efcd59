"""The ``blazar-proxy`` command: parse flags (and BLAZAR_* variables), then serve."""

from __future__ import annotations

import click
import uvicorn

from proxy import __version__
from proxy.app import build_app
from proxy.config import Settings
from proxy.relay import RelaySettings
from proxy.routing import RoutingTable, UpstreamSpecError, parse_upstream_spec

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@click.group(invoke_without_command=True, context_settings={"show_default": True})
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="NAME=URL",
    envvar="BLAZAR_UPSTREAM",
    show_envvar=True,
    help="Serve model NAME from the OpenAI-compatible server at URL "
    "(e.g. qwen=http://127.0.0.1:8080/v1). Repeatable; in the variable, "
    "separate several with spaces.",
)
@click.option("--host", default="127.0.0.1", envvar="BLAZAR_HOST", show_envvar=True, help="Address to bind.")
@click.option(
    "--port",
    default=8000,
    type=click.IntRange(0, 65535),
    envvar="BLAZAR_PORT",
    show_envvar=True,
    help="Port to bind.",
)
@click.option(
    "--max-body-bytes",
    default=32 * 1024 * 1024,
    type=click.IntRange(1),
    envvar="BLAZAR_MAX_BODY_BYTES",
    show_envvar=True,
    help="Largest request body accepted; larger ones get 413.",
)
@click.option(
    "--connect-timeout",
    "connect_timeout_s",
    default=5.0,
    type=click.FloatRange(0, min_open=True),
    envvar="BLAZAR_CONNECT_TIMEOUT",
    show_envvar=True,
    help="Seconds to open a connection to an upstream; past it, 503.",
)
@click.option(
    "--first-byte-timeout",
    "first_byte_timeout_s",
    default=600.0,
    type=click.FloatRange(0, min_open=True),
    envvar="BLAZAR_FIRST_BYTE_TIMEOUT",
    show_envvar=True,
    help="Seconds to wait for an upstream's response head (prefill can take minutes); past it, 504.",
)
@click.option(
    "--log-level",
    default="info",
    type=click.Choice(_LOG_LEVELS),
    envvar="BLAZAR_LOG_LEVEL",
    show_envvar=True,
    help="Log level.",
)
@click.version_option(__version__, prog_name="blazar-proxy")
@click.pass_context
def main(
    ctx: click.Context,
    upstreams: tuple[str, ...],
    host: str,
    port: int,
    max_body_bytes: int,
    connect_timeout_s: float,
    first_byte_timeout_s: float,
    log_level: str,
) -> None:
    """An OpenAI-compatible gateway in front of local LLM engine servers.

    Clients send OpenAI API requests to this gateway; each goes to the
    upstream that serves the request's `model`, and the response bytes come
    back as they arrive.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not upstreams:
        raise click.UsageError("nothing to serve: give at least one --upstream NAME=URL")
    try:
        routes = tuple(parse_upstream_spec(spec) for spec in upstreams)
        RoutingTable(routes)
    except UpstreamSpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--upstream") from None
    settings = Settings(
        routes=routes,
        host=host,
        port=port,
        max_body_bytes=max_body_bytes,
        connect_timeout_s=connect_timeout_s,
        first_byte_timeout_s=first_byte_timeout_s,
        log_level=log_level,
    )
    serve(settings)


def serve(settings: Settings) -> None:
    """Run the gateway until it is stopped."""
    app = build_app(
        RoutingTable(settings.routes),
        relay_settings=RelaySettings(
            max_body_bytes=settings.max_body_bytes, head_timeout_s=settings.first_byte_timeout_s
        ),
        connect_timeout_s=settings.connect_timeout_s,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        access_log=False,
        server_header=False,
        # The gateway does not use the client address; the middleware that
        # rewrites it from X-Forwarded-For would cost every request.
        proxy_headers=False,
        log_level=settings.log_level,
    )
    uvicorn.Server(config).run()
