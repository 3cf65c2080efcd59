"""Engine versions as data: one TOML file per version in ``engines/specs/``.

Adding ``mlx-0.31.x`` or a new engine version is adding a file; nothing here
knows about any particular engine.
"""

from __future__ import annotations

import itertools
import os
import re
import string
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from engines import kinds as engine_kinds

VARIANTS = ("cpu", "cuda12", "cuda13", "metal")
CUDA_VARIANTS = frozenset(v for v in VARIANTS if v.startswith("cuda"))
# What a user may ask for: a variant, or auto (engines.variant picks one for the machine).
VARIANT_CHOICES = ("auto", *VARIANTS)
# How the child is told the name it serves (see engines/DESIGN.md):
# run-dir-symlink: {model} is a link named like the served model in the run
#   directory (an engine that loads whatever the request's model names);
# alias: {model} is the model's path and {served_name} its name (an engine
#   that serves one model, whatever the request's model field says).
MODEL_FIELD_MODES = frozenset({"run-dir-symlink", "alias"})
_PLACEHOLDERS = frozenset(
    {"python", "model", "served_name", "host", "port", "half_the_cores", "engines_dir"}
    | {"site_packages", "slots"}
)
# What an ``[install.build_env]`` value may name: this machine's cores.
_BUILD_PLACEHOLDERS = frozenset({"cores"})
# The argv placeholders whose flags engine-args may not set again: what the
# gateway fills in itself (the rest, such as {slots}, a model may change).
_RESERVED = frozenset({"model", "served_name", "host", "port"})
# A PEP 517 config setting, KEY=VALUE, such as cmake.args=-DGGML_CUDA=on.
_CONFIG_SETTING = re.compile(r"[A-Za-z_][\w.-]*=")


class SpecError(ValueError):
    """An engine spec that is missing, malformed or inconsistent."""


@dataclass(frozen=True, slots=True)
class Slots:
    """A server's count of requests generated at once, set by one of its flags.

    The default follows the machine: ``per_core`` times its cores, from
    ``low`` to ``high``. A model's engine-args may set the flag again; the
    gateway's admission then follows that value (``EngineSpec.slots_for``).
    """

    flag: str
    per_core: int = 1
    low: int = 1
    high: int = 64

    def default(self, cores: int | None = None) -> int:
        return max(self.low, min(self.high, self.per_core * (cores or os.cpu_count() or 1)))


@dataclass(frozen=True, slots=True)
class Readiness:
    path: str
    max_tokens: int
    timeout_s: float
    # Empty: the engine has no health route; only the generation probe watches it.
    health_path: str
    probe_interval_s: float = 60.0
    probe_timeout_s: float = 300.0


# The guards read from the spec's [nonstream] table; the rest are [guards].
_NONSTREAM = {"table": "nonstream"}


# What a request field's value may be (see RequestField.kind).
FIELD_KINDS = frozenset(
    {
        "boolean",
        "integer",
        "number",
        "float",
        "string",
        "strings",
        "object",
        "scalars",
        "array",
        "token_bias",
        "bias",
    }
)
# Facts of a model a bound may name (``max = "vocab_size - 1"``): each a Guards
# field set per route from the model's files, None where they do not say.
MODEL_FACTS = ("vocab_size", "context_length")
# A bound naming a model fact: the fact, optionally less a whole number.
_FACT_BOUND = re.compile(r"(?P<fact>[a-z_]+)(?:\s*-\s*(?P<less>[0-9]+))?")
# The keys of a field's rule, and the kinds each is for.
_RULE_KEYS: dict[str, frozenset[str] | None] = {
    "type": None,
    "min": frozenset({"integer", "number", "float"}),
    "max": frozenset({"integer", "number", "float"}),
    "null": None,
    "loads": None,
    "min_length": frozenset({"string", "strings"}),
    "max_length": frozenset({"string", "strings"}),
    "max_items": frozenset({"strings", "array"}),
    "refused_keys": frozenset({"object", "scalars"}),
    "members": frozenset({"object"}),
}


@dataclass(frozen=True, slots=True)
class RequestField:
    """One request field the engine's server reads: what it takes, as its own source says.

    A spec declares them in ``[fields]`` (every endpoint) and
    ``[completion_fields]`` (the legacy completions endpoint, where they
    differ), ``name = { type = ..., min = ..., max = ..., null = ..., loads = ... }``.
    """

    name: str
    # boolean; integer; number (an integer or a float); float (a JSON number
    # written with a fraction or an exponent: Python's float only, as mlx
    # checks xtc_*); string; strings (a string or a list of strings); object;
    # scalars (an object of strings, numbers, booleans and nulls: no lists or
    # objects); array; token_bias (an object of token ids, canonical decimal
    # integers from 0 and below the model's vocab_size where it is known, to
    # numbers); bias (an object of numbers).
    kind: str
    # Inclusive bounds of a number.
    low: float | None = None
    high: float | None = None
    # An upper bound from a fact of the model (MODEL_FACTS) less a number:
    # ("vocab_size", 1) is "below the vocabulary". Applies where the model's
    # files give the fact (the lower of it and ``high``).
    high_fact: tuple[str, int] | None = None
    # Each string's length in characters (string, strings), and the most
    # items a list may have (strings, array).
    min_length: int | None = None
    max_length: int | None = None
    max_items: int | None = None
    # An object's keys the server must not be given (object, scalars).
    refused_keys: frozenset[str] = frozenset()
    # An object's members the server reads whenever the object is given: each
    # must be there, of its kind (boolean, integer, number, string).
    members: tuple[tuple[str, str], ...] = ()
    # The server takes null (its default). Otherwise a null is left out of the
    # body on its way (OpenAI's meaning of null: the default).
    takes_null: bool = False
    # The value names something the server loads or fetches (a model, an
    # adapter): refused unless the model's config allows the field.
    loads: bool = False
    # "" for every endpoint; "/completions" for the legacy one only.
    endpoint: str = ""


# The guards read from the spec's [nonstream] table, those from its field
# tables, and the one a model's config sets; the rest are [guards].
_NONSTREAM = {"table": "nonstream"}
_FIELDS = {"table": "fields"}
_PER_MODEL = {"table": ""}
_APIS = {"table": "apis"}
# The APIs a server may serve itself (proxy.endpoints.NATIVE_APIS: engines may not import proxy).
NATIVE_APIS = ("messages", "responses")


@dataclass(frozen=True, slots=True)
class Guards:
    """What the gateway does to a request because the engine behind it breaks without it.

    Every guard, its default and its meaning are written here once. A spec
    fills it from its ``[guards]`` table (request checks), its ``[fields]``
    and ``[completion_fields]`` tables (the fields its server reads) and its
    ``[nonstream]`` table (how non-stream requests reach the engine); a route
    with no engine named gets these defaults. The request path reads it
    through ``proxy.payload.RequestGuards``, a protocol of the same names.
    """

    # max_tokens and max_completion_tokens must be integers of at least this;
    # 1 holds for every route (OpenAI rejects 0 too; mlx's generation thread
    # dies for good on 0).
    min_max_tokens: int = 1
    # A chat without messages (or with a message that is not an object with
    # a string role), or a completion without prompt, is a 400 (mlx_lm.server
    # answers them with an empty reply).
    require_input: bool = False
    # The fields the server reads, with their types and ranges: a value it
    # cannot take is a 400 naming the field (mlx_lm.server closes the socket
    # without a reply). None for a server the
    # gateway knows nothing of: its fields go as they are.
    fields: tuple[RequestField, ...] = field(default=(), metadata=_FIELDS)
    # Fields of ``loads`` that this model's config allows (a model's
    # allow-fields, set per route; never from a spec).
    allowed: frozenset[str] = field(default=frozenset(), metadata=_PER_MODEL)
    # The model's vocabulary size where it is known (an MLX directory's
    # config.json): token ids a request names (token_bias fields) must be
    # below it. Set per route, never from a spec.
    vocab_size: int | None = field(default=None, metadata=_PER_MODEL)
    # The model's context length where it is known (config.json's
    # max_position_embeddings): a bound fields may name (max_tokens). Set per
    # route, never from a spec.
    context_length: int | None = field(default=None, metadata=_PER_MODEL)
    # An engine that never notices a non-stream client has gone (it writes
    # the reply only at the end): ask it for a stream and build the
    # non-stream reply from its events (proxy/assembly.py) ...
    via_stream: bool = field(default=False, metadata=_NONSTREAM)
    # ... unless the request sets one of these fields, whose answer only a
    # non-stream reply carries: then it is sent as it is.
    stream_cannot_carry: tuple[str, ...] = field(default=(), metadata=_NONSTREAM)
    # The APIs besides chat completions the server serves itself ("messages": the
    # Anthropic Messages API, with count_tokens; "responses": the OpenAI Responses
    # API): requests to them go through untouched. The others are translated to
    # chat completions by the gateway. A spec's [apis] native_apis, or a model's
    # native-apis (a static upstream's).
    native_apis: tuple[str, ...] = field(default=(), metadata=_APIS)
    # The most tokens a request may ask this model to generate, on every API (a
    # model's max-tokens): a request asking for more, or for none, asks for this
    # many. Set per route, never from a spec.
    max_tokens: int | None = field(default=None, metadata=_PER_MODEL)

    def __hash__(self) -> int:
        # A reload compares routes, guards included, by value: hashing the whole
        # fields tuple cost 5 µs, this a tenth. Equal guards hash equal.
        return hash(
            (
                self.min_max_tokens,
                self.require_input,
                self.via_stream,
                len(self.fields),
                self.allowed,
                self.vocab_size,
                self.context_length,
                self.native_apis,
                self.max_tokens,
            )
        )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    kind: str
    version: str
    summary: str
    model_formats: tuple[str, ...]
    packages: dict[str, tuple[str, ...]]
    argv: tuple[str, ...]
    http_version: str
    batch_size: int
    readiness: Readiness
    model_field: str
    guards: Guards
    # uv/pip --config-setting KEY=VALUE per variant, for packages built from
    # source; uv's cache keys a built wheel on these (not on the environment).
    config_settings: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Variables the child must not inherit because the engine reads them.
    env_drop: tuple[str, ...] = ()
    # What is compiled at install (e.g. llama.cpp); empty: wheels only.
    builds_from_source: str = ""
    # Variables the build reads, per variant ({cores} filled in at install): the
    # installer sets them and passes each as a config setting too, for uv's cache.
    build_env: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    # The build needs the system's C and C++ compilers (checked before it starts).
    needs_compiler: bool = False
    # Short spellings of the argv's flags (-m for --model): engine-args may not
    # set what the gateway sets by either.
    flag_aliases: tuple[tuple[str, str], ...] = ()
    # The server's parallel slots, where a flag sets them (batch_size is then
    # their default on this machine).
    slots: Slots | None = None
    # Where the server exports Prometheus metrics ("": nowhere).
    metrics_path: str = ""
    # A CUDA variant's toolkit: "wheels" (an engine-local CUDA_HOME made from
    # the venv's nvidia-* wheels, for run-time compilers such as mlx's NVRTC)
    # or "system" (the machine's toolkit, which a build from source compiles
    # against; the child gets that CUDA_HOME).
    cuda_toolkit: str = "wheels"

    def config_settings_for(self, variant: str) -> tuple[str, ...]:
        """The build's config settings for ``variant``: the spec's, then one per build variable."""
        return (
            *self.config_settings.get(variant, ()),
            *(f"build-env.{name}={value}" for name, value in self.build_env_for(variant)),
        )

    def build_env_for(self, variant: str, cores: int | None = None) -> tuple[tuple[str, str], ...]:
        """The variables the build of ``variant`` reads, with this machine's values filled in."""
        values = {"cores": str(cores or os.cpu_count() or 1)}
        return tuple((name, value.format_map(values)) for name, value in self.build_env.get(variant, ()))

    def slots_for(self, extra_args: Sequence[str] = ()) -> int:
        """Requests one child generates at once: the slots flag in ``extra_args`` (last), or its default."""
        if self.slots is None:
            return self.batch_size
        flag = self.slots.flag
        spellings = {flag, *(short for short, long in self.flag_aliases if long == flag)}
        found = self.slots.default()
        for index, arg in enumerate(extra_args):
            flag, equals, value = arg.partition("=")
            if flag not in spellings:
                continue
            if not equals:
                value = extra_args[index + 1] if index + 1 < len(extra_args) else ""
            try:
                found = int(value)
            except ValueError:
                raise SpecError(f"{flag} must be followed by a whole number, not {value!r}") from None
            if found < 1:
                raise SpecError(f"{flag} {found}: the gateway needs a count of at least 1 (not auto)")
        return found

    def packages_for(self, variant: str) -> tuple[str, ...]:
        try:
            return self.packages[variant]
        except KeyError:
            raise SpecError(
                f"engine {self.name} has no {variant!r} variant; it has {', '.join(self.packages)}"
            ) from None

    def server_argv(
        self,
        *,
        python: str,
        model: str,
        host: str,
        port: int,
        served_name: str | None = None,
        site_packages: str = "",
    ) -> list[str]:
        """The child's command line, with the template's placeholders filled."""
        values = {
            # For engines that would take every core and stall under other load.
            "half_the_cores": str(max(1, (os.cpu_count() or 2) // 2)),
            # Scripts of this package that a child runs with its engine's Python.
            "engines_dir": str(Path(__file__).resolve().parent),
            "python": python,
            "model": model,
            "served_name": model if served_name is None else served_name,
            "host": host,
            "port": str(port),
            "site_packages": site_packages,
            "slots": str(self.slots.default() if self.slots else self.batch_size),
        }
        return [part.format_map(values) for part in self.argv]

    def reserved_flags(self) -> frozenset[str]:
        """The flags (and their short spellings) by which argv sets what the gateway fills in."""
        reserved = {
            flag
            for flag, value in itertools.pairwise(self.argv)
            if flag.startswith("-")
            and any(name in _RESERVED for _, name, _, _ in string.Formatter().parse(value) if name)
        }
        return frozenset({*reserved, *(short for short, long in self.flag_aliases if long in reserved)})


def available() -> list[str]:
    """The names of every spec shipped with this package."""
    root = resources.files("engines") / "specs"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


# Engine versions no longer shipped, and what serves their models now.
RETIRED = {"llamacpp-0.3.36": "llamacpp-b11434"}


def load(name: str) -> EngineSpec:
    """Load the spec of engine version ``name`` (e.g. ``mlx-0.32.0``)."""
    path = resources.files("engines") / "specs" / f"{name}.toml"
    if name in RETIRED and not path.is_file():
        raise SpecError(
            f"engine {name} is retired: {RETIRED[name]} serves the same GGUF files (llama.cpp's own "
            f"llama-server, several requests at once); `blazar-proxy engines remove {name}` frees its folder"
        )
    if not path.is_file():
        raise SpecError(f"unknown engine {name!r}; known engines: {', '.join(available())}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"engine spec {name}.toml: {exc}") from None
    return parse(data, source=f"{name}.toml")


def parse(data: dict[str, Any], *, source: str) -> EngineSpec:
    """Validate a spec's TOML table into an EngineSpec."""
    read = _Reader(source)
    packages = _packages(read, read.need(data, "packages", dict, ""))
    server = read.need(data, "server", dict, "")
    argv = _argv(read, server)
    readiness = read.need(data, "readiness", dict, "")
    mode = _model_field(read, read.need(data, "model_field", dict, ""))
    used = {name for part in argv for _, name, _, _ in string.Formatter().parse(part) if name}
    unknown = used - _PLACEHOLDERS
    if unknown:
        raise SpecError(f"{source}: server.argv has unknown placeholders {sorted(unknown)}")
    if mode == "alias" and not {"model", "served_name"} <= used:
        raise SpecError(
            f"{source}: model_field.mode alias needs {{model}} and {{served_name}} in server.argv"
        )
    health_path = _path(read, readiness, "health_path", "readiness.")
    install = read.table(data, "install")
    config_settings = _config_settings(read, install, packages)
    builds_from_source = install.get("builds_from_source", "")
    if not isinstance(builds_from_source, str):
        raise SpecError(f"{source}: install.builds_from_source must be a string")
    env_drop = server.get("env_drop", [])
    if not isinstance(env_drop, list) or not all(isinstance(n, str) and n.rstrip("*") for n in env_drop):
        raise SpecError(f"{source}: server.env_drop must be a list of variable names (NAME or PREFIX*)")
    needs_compiler = read.flag(install, "needs_compiler", False, "install.")
    build_env = _build_env(read, install, packages)
    flag_aliases = _flag_aliases(read, server, argv)
    slots = _slots(read, server, argv)
    spec = EngineSpec(
        name=read.need(data, "name", str, ""),
        kind=read.need(data, "kind", str, ""),
        version=read.need(data, "version", str, ""),
        summary=str(data.get("summary", "")),
        model_formats=tuple(read.need(data, "model_formats", list, "")),
        packages=packages,
        argv=tuple(argv),
        http_version=str(server.get("http_version", "1.1")),
        batch_size=slots.default() if slots else int(read.number(server, "batch_size", 1, "server.")),
        readiness=_readiness(read, readiness, health_path),
        model_field=mode,
        guards=_guards(read, data),
        config_settings=config_settings,
        env_drop=tuple(env_drop),
        builds_from_source=builds_from_source,
        build_env=build_env,
        needs_compiler=needs_compiler,
        flag_aliases=flag_aliases,
        slots=slots,
        metrics_path=_path(read, server, "metrics_path"),
        cuda_toolkit=_choice(read, install, "cuda_toolkit", ("wheels", "system"), "install."),
    )
    if slots is not None and "batch_size" in server:
        raise SpecError(f"{source}: server.batch_size and server.slots both set; slots decides")
    if spec.kind not in engine_kinds.KINDS:
        raise SpecError(f"{source}: kind {spec.kind!r} is not one of {', '.join(engine_kinds.KINDS)}")
    if source.endswith(".toml") and spec.name != source.removesuffix(".toml"):
        raise SpecError(f"{source}: name {spec.name!r} does not match the file name")
    return spec


class _Reader:
    """Values read from one spec's tables, checked; errors name the file and the key."""

    def __init__(self, source: str) -> None:
        self.source = source

    def need(self, table: dict[str, Any], key: str, kind: type, where: str) -> Any:
        value = table.get(key)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise SpecError(f"{self.source}: {where}{key} must be a {kind.__name__}")
        return value

    def table(self, data: dict[str, Any], key: str) -> dict[str, Any]:
        """An optional table (empty when absent)."""
        value = data.get(key, {})
        if not isinstance(value, dict):
            raise SpecError(f"{self.source}: {key} must be a table")
        return value

    def number(self, table: dict[str, Any], key: str, default: float, where: str) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.source}: {where}{key} must be a number")
        return value

    def flag(self, table: dict[str, Any], key: str, default: bool, where: str) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.source}: {where}{key} must be true or false")
        return value


def _packages(read: _Reader, table: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    packages: dict[str, tuple[str, ...]] = {}
    for variant, pins in table.items():
        if variant not in VARIANTS:
            raise SpecError(
                f"{read.source}: packages.{variant}: unknown variant; known: {', '.join(VARIANTS)}"
            )
        if not isinstance(pins, list) or not pins or not all(isinstance(p, str) and p for p in pins):
            raise SpecError(f"{read.source}: packages.{variant} must be a non-empty list of requirements")
        packages[variant] = tuple(pins)
    return packages


def _argv(read: _Reader, server: dict[str, Any]) -> list[str]:
    argv: list[str] = read.need(server, "argv", list, "server.")
    if not argv or not all(isinstance(a, str) for a in argv) or "{port}" not in argv:
        raise SpecError(f"{read.source}: server.argv must be a list of strings that includes {{port}}")
    return argv


def _model_field(read: _Reader, table: dict[str, Any]) -> str:
    mode: str = read.need(table, "mode", str, "model_field.")
    if mode not in MODEL_FIELD_MODES:
        raise SpecError(f"{read.source}: model_field.mode {mode!r} is not one of {sorted(MODEL_FIELD_MODES)}")
    return mode


def _config_settings(
    read: _Reader, install: dict[str, Any], packages: dict[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    table = install.get("config_settings", {})
    if not isinstance(table, dict):
        raise SpecError(f"{read.source}: install.config_settings must be a table of variants")
    config_settings: dict[str, tuple[str, ...]] = {}
    for variant, settings in table.items():
        if variant not in packages:
            raise SpecError(f"{read.source}: install.config_settings.{variant}: the spec has no such variant")
        if not isinstance(settings, list) or not all(
            isinstance(s, str) and _CONFIG_SETTING.match(s) for s in settings
        ):
            raise SpecError(
                f"{read.source}: install.config_settings.{variant} must be a list of KEY=VALUE strings"
            )
        config_settings[variant] = tuple(settings)
    return config_settings


def _choice(read: _Reader, table: dict[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
    value = table.get(key, choices[0])
    if value not in choices:
        raise SpecError(f"{read.source}: {where}{key} must be one of {', '.join(choices)}")
    return str(value)


def _path(read: _Reader, table: dict[str, Any], key: str, where: str = "server.") -> str:
    """An optional path of the server's: "" when absent."""
    value = table.get(key, "")
    if not isinstance(value, str) or (value and not value.startswith("/")):
        raise SpecError(f"{read.source}: {where}{key} must be a path starting with / (or absent)")
    return value


def _build_env(
    read: _Reader, install: dict[str, Any], packages: dict[str, tuple[str, ...]]
) -> dict[str, tuple[tuple[str, str], ...]]:
    table = install.get("build_env", {})
    if not isinstance(table, dict):
        raise SpecError(f"{read.source}: install.build_env must be a table of variants")
    found: dict[str, tuple[tuple[str, str], ...]] = {}
    for variant, variables in table.items():
        where = f"{read.source}: install.build_env.{variant}"
        if variant not in packages:
            raise SpecError(f"{where}: the spec has no such variant")
        if not isinstance(variables, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Z_][A-Z0-9_]*", k) and isinstance(v, str)
            for k, v in variables.items()
        ):
            raise SpecError(f'{where} must be a table of NAME = "value"')
        for name, value in variables.items():
            used = {n for _, n, _, _ in string.Formatter().parse(value) if n}
            if used - _BUILD_PLACEHOLDERS:
                raise SpecError(f"{where}.{name}: unknown placeholders {sorted(used - _BUILD_PLACEHOLDERS)}")
        found[variant] = tuple(variables.items())
    return found


def _flag_aliases(read: _Reader, server: dict[str, Any], argv: list[str]) -> tuple[tuple[str, str], ...]:
    table = server.get("flag_aliases", {})
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and k.startswith("-") and isinstance(v, str) and v in argv
        for k, v in table.items()
    ):
        raise SpecError(f"{read.source}: server.flag_aliases must map short flags to flags of server.argv")
    return tuple(table.items())


def _slots(read: _Reader, server: dict[str, Any], argv: list[str]) -> Slots | None:
    table = server.get("slots")
    if table is None:
        return None
    where = "server.slots."
    if not isinstance(table, dict) or set(table) - {"flag", "per_core", "min", "max"}:
        raise SpecError(f"{read.source}: server.slots must be a table of flag, per_core, min and max")
    flag = read.need(table, "flag", str, where)
    if flag not in argv or argv.index(flag) + 1 >= len(argv) or argv[argv.index(flag) + 1] != "{slots}":
        raise SpecError(
            f"{read.source}: server.slots.flag {flag!r} must be followed by {{slots}} in server.argv"
        )
    slots = Slots(
        flag=flag,
        per_core=int(read.number(table, "per_core", 1, where)),
        low=int(read.number(table, "min", 1, where)),
        high=int(read.number(table, "max", 64, where)),
    )
    if not 1 <= slots.low <= slots.high or slots.per_core < 1:
        raise SpecError(f"{read.source}: server.slots needs 1 <= min <= max and per_core >= 1")
    return slots


def _readiness(read: _Reader, table: dict[str, Any], health_path: str) -> Readiness:
    return Readiness(
        path=read.need(table, "path", str, "readiness."),
        max_tokens=int(read.number(table, "max_tokens", 1, "readiness.")),
        timeout_s=float(read.number(table, "timeout_s", 600.0, "readiness.")),
        health_path=health_path,
        probe_interval_s=float(read.number(table, "probe_interval_s", 60.0, "readiness.")),
        probe_timeout_s=float(read.number(table, "probe_timeout_s", 300.0, "readiness.")),
    )


def _field(read: _Reader, name: str, rule: Any, where: str, endpoint: str) -> RequestField:
    """One ``name = { type = ..., min = ..., max = ..., null = ..., loads = ..., ... }`` of a field table."""
    if not isinstance(rule, dict):
        raise SpecError(f"{read.source}: {where}{name} must be a table {{ type = ... }}")
    unknown = set(rule) - set(_RULE_KEYS)
    if unknown:
        raise SpecError(f"{read.source}: {where}{name}: unknown key {sorted(unknown)[0]!r}")
    kind = rule.get("type")
    if kind not in FIELD_KINDS:
        raise SpecError(f"{read.source}: {where}{name}.type must be one of {', '.join(sorted(FIELD_KINDS))}")
    for key, kinds in _RULE_KEYS.items():
        if key in rule and kinds is not None and kind not in kinds:
            raise SpecError(
                f"{read.source}: {where}{name}: {key} is for {' and '.join(sorted(kinds))}, not {kind}"
            )
    at = f"{where}{name}."
    low = _number_bound(read, rule, "min", at)
    high, high_fact = _upper_bound(read, rule, at)
    return RequestField(
        name=name,
        kind=kind,
        low=low,
        high=high,
        high_fact=high_fact,
        min_length=_count(read, rule, "min_length", at),
        max_length=_count(read, rule, "max_length", at),
        max_items=_count(read, rule, "max_items", at),
        refused_keys=frozenset(_names(read, rule, "refused_keys", at)),
        members=_members(read, rule, at),
        takes_null=read.flag(rule, "null", False, at),
        loads=read.flag(rule, "loads", False, at),
        endpoint=endpoint,
    )


def _number_bound(read: _Reader, rule: dict[str, Any], key: str, at: str) -> float | None:
    value = rule.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SpecError(f"{read.source}: {at}{key} must be a number")
    return value


def _upper_bound(read: _Reader, rule: dict[str, Any], at: str) -> tuple[float | None, tuple[str, int] | None]:
    """``max``: a number, a model fact (``"vocab_size - 1"``), or a list of one of each (the lower rules)."""
    value = rule.get("max")
    parts = value if isinstance(value, list) else [] if value is None else [value]
    numbers = [p for p in parts if not isinstance(p, str)]
    facts = [p for p in parts if isinstance(p, str)]
    if len(numbers) > 1 or len(facts) > 1 or (isinstance(value, list) and not value):
        raise SpecError(f"{read.source}: {at}max must be a number, a model fact, or one of each")
    high = _number_bound(read, {"max": numbers[0]}, "max", at) if numbers else None
    if not facts:
        return high, None
    match = _FACT_BOUND.fullmatch(facts[0].strip())
    if match is None or match["fact"] not in MODEL_FACTS:
        raise SpecError(
            f"{read.source}: {at}max {facts[0]!r} must name a model fact ({', '.join(MODEL_FACTS)}), "
            'optionally less a whole number ("vocab_size - 1")'
        )
    return high, (match["fact"], int(match["less"] or 0))


def _count(read: _Reader, rule: dict[str, Any], key: str, at: str) -> int | None:
    value = rule.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SpecError(f"{read.source}: {at}{key} must be a whole number")
    return value


def _names(read: _Reader, rule: dict[str, Any], key: str, at: str) -> list[str]:
    names = rule.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise SpecError(f"{read.source}: {at}{key} must be a list of names")
    return names


# The kinds an object's member may be declared of (``members``).
MEMBER_KINDS = frozenset({"boolean", "integer", "number", "string"})


def _members(read: _Reader, rule: dict[str, Any], at: str) -> tuple[tuple[str, str], ...]:
    table = rule.get("members", {})
    if not isinstance(table, dict) or not all(k in MEMBER_KINDS for k in table.values()):
        raise SpecError(
            f"{read.source}: {at}members must be a table of member = kind ({', '.join(sorted(MEMBER_KINDS))})"
        )
    return tuple(table.items())


def _fields(read: _Reader, data: dict[str, Any]) -> tuple[RequestField, ...]:
    """``[fields]`` (every endpoint), then ``[completion_fields]`` (the legacy completions one)."""
    found: list[RequestField] = []
    for table, endpoint in (("fields", ""), ("completion_fields", "/completions")):
        for name, rule in read.table(data, table).items():
            found.append(_field(read, name, rule, f"{table}.", endpoint))
    return tuple(found)


def _guards(read: _Reader, data: dict[str, Any]) -> Guards:
    """``[guards]``, ``[nonstream]`` and the field tables: each guard read by its default's type."""
    tables = {name: read.table(data, name) for name in ("guards", "nonstream", "apis")}
    values: dict[str, Any] = {"fields": _fields(read, data)}
    for item in fields(Guards):
        name = item.metadata.get("table", "guards")
        if name not in tables:
            continue  # the field tables (above), and what a model's config sets
        table, key, default, where = tables[name], item.name, item.default, f"{name}."
        if isinstance(default, bool):
            values[key] = read.flag(table, key, default, where)
        elif isinstance(default, tuple):
            names = table.get(key, [])
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise SpecError(f"{read.source}: {where}{key} must be a list of field names")
            values[key] = tuple(names)
        elif key in table:
            values[key] = int(read.number(table, key, 0, where))
    unknown = set(tables["guards"]) - {f.name for f in fields(Guards) if "table" not in f.metadata}
    if unknown:
        raise SpecError(f"{read.source}: guards.{sorted(unknown)[0]}: unknown guard")
    unknown = set(tables["apis"]) - {"native_apis"}
    if unknown:
        raise SpecError(f"{read.source}: apis.{sorted(unknown)[0]}: unknown key (apis has native_apis)")
    for api in values.get("native_apis", ()):
        if api not in NATIVE_APIS:
            raise SpecError(
                f"{read.source}: apis.native_apis: {api!r} is not an API the gateway knows "
                f"({', '.join(NATIVE_APIS)})"
            )
    return Guards(**values)
