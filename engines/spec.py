"""Engine versions as data: one TOML file per version in ``engines/specs/``.

Adding ``mlx-0.31.x`` or a new engine version is adding a file; nothing here
knows about any particular engine.
"""

from __future__ import annotations

import os
import re
import string
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

VARIANTS = ("cpu", "cuda12", "cuda13", "metal")
CUDA_VARIANTS = frozenset({"cuda12", "cuda13"})
# How the child is told the name it serves (see engines/DESIGN.md):
# run-dir-symlink: {model} is a link named like the served model in the run
#   directory (an engine that loads whatever the request's model names);
# alias: {model} is the model's path and {served_name} its name (an engine
#   that serves one model, whatever the request's model field says).
MODEL_FIELD_MODES = frozenset({"run-dir-symlink", "alias"})
_PLACEHOLDERS = frozenset({"python", "model", "served_name", "host", "port", "half_the_cores", "engines_dir"})
# A PEP 517 config setting, KEY=VALUE, such as cmake.args=-DGGML_CUDA=on.
_CONFIG_SETTING = re.compile(r"[A-Za-z_][\w.-]*=")


def _choice(table: dict[str, Any], key: str, choices: tuple[str, ...], source: str) -> str:
    value = table.get(key, choices[0])
    if value not in choices:
        raise SpecError(f"{source}: guards.{key} must be one of {', '.join(choices)}, not {value!r}")
    return str(value)


class SpecError(ValueError):
    """An engine spec that is missing, malformed or inconsistent."""


@dataclass(frozen=True, slots=True)
class Readiness:
    path: str
    max_tokens: int
    timeout_s: float
    # Empty: the engine has no health route; only the generation probe watches it.
    health_path: str
    probe_interval_s: float = 60.0
    probe_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Guards:
    """Request checks the gateway makes because the engine breaks on them."""

    min_max_tokens: int = 1
    require_input: bool = False
    # Sampling fields of the wrong type or range: mlx_lm.server closes the
    # socket without a reply, llama_cpp.server answers 500.
    check_types: bool = False
    # Limits of the engine's own (None / 20: OpenAI's).
    seed_min: int | None = None
    top_logprobs_max: int = 20
    # "count" (OpenAI's legacy completions API) or "flag" (a boolean, as in chat).
    completion_logprobs: str = "count"


@dataclass(frozen=True, slots=True)
class NonStream:
    """How non-stream requests reach an engine that cannot notice their client leaving."""

    # Ask the engine for a stream and build the non-stream reply from its events.
    via_stream: bool = False
    # Request fields whose answer only a non-stream reply carries: sent as they are.
    stream_cannot_carry: tuple[str, ...] = ()


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
    # What is compiled at install (e.g. llama-cpp-python); empty: wheels only.
    builds_from_source: str = ""
    nonstream: NonStream = NonStream()

    def config_settings_for(self, variant: str) -> tuple[str, ...]:
        """The build's config settings for ``variant`` (none for most engines)."""
        return self.config_settings.get(variant, ())

    def packages_for(self, variant: str) -> tuple[str, ...]:
        try:
            return self.packages[variant]
        except KeyError:
            raise SpecError(
                f"engine {self.name} has no {variant!r} variant; it has {', '.join(self.packages)}"
            ) from None

    def server_argv(
        self, *, python: str, model: str, host: str, port: int, served_name: str | None = None
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
        }
        return [part.format_map(values) for part in self.argv]


def available() -> list[str]:
    """The names of every spec shipped with this package."""
    root = resources.files("engines") / "specs"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def load(name: str) -> EngineSpec:
    """Load the spec of engine version ``name`` (e.g. ``mlx-0.32.0``)."""
    path = resources.files("engines") / "specs" / f"{name}.toml"
    if not path.is_file():
        raise SpecError(f"unknown engine {name!r}; known engines: {', '.join(available())}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"engine spec {name}.toml: {exc}") from None
    return parse(data, source=f"{name}.toml")


def parse(data: dict[str, Any], *, source: str) -> EngineSpec:
    """Validate a spec's TOML table into an EngineSpec."""

    def need(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
        value = table.get(key)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise SpecError(f"{source}: {where}{key} must be a {kind.__name__}")
        return value

    packages_table = need(data, "packages", dict, "")
    packages: dict[str, tuple[str, ...]] = {}
    for variant, pins in packages_table.items():
        if variant not in VARIANTS:
            raise SpecError(f"{source}: packages.{variant}: unknown variant; known: {', '.join(VARIANTS)}")
        if not isinstance(pins, list) or not pins or not all(isinstance(p, str) and p for p in pins):
            raise SpecError(f"{source}: packages.{variant} must be a non-empty list of requirements")
        packages[variant] = tuple(pins)
    server = need(data, "server", dict, "")
    argv = need(server, "argv", list, "server.")
    if not argv or not all(isinstance(a, str) for a in argv) or "{port}" not in argv:
        raise SpecError(f"{source}: server.argv must be a list of strings that includes {{port}}")
    readiness = need(data, "readiness", dict, "")
    model_field = need(data, "model_field", dict, "")
    mode = need(model_field, "mode", str, "model_field.")
    if mode not in MODEL_FIELD_MODES:
        raise SpecError(f"{source}: model_field.mode {mode!r} is not one of {sorted(MODEL_FIELD_MODES)}")
    guards = data.get("guards", {})
    if not isinstance(guards, dict):
        raise SpecError(f"{source}: guards must be a table")
    used = {name for part in argv for _, name, _, _ in string.Formatter().parse(part) if name}
    unknown = used - _PLACEHOLDERS
    if unknown:
        raise SpecError(f"{source}: server.argv has unknown placeholders {sorted(unknown)}")
    if mode == "alias" and not {"model", "served_name"} <= used:
        raise SpecError(
            f"{source}: model_field.mode alias needs {{model}} and {{served_name}} in server.argv"
        )
    health_path = readiness.get("health_path", "")
    if not isinstance(health_path, str) or (health_path and not health_path.startswith("/")):
        raise SpecError(f"{source}: readiness.health_path must be a path starting with / (or absent)")
    install = data.get("install", {})
    if not isinstance(install, dict):
        raise SpecError(f"{source}: install must be a table")
    settings_table = install.get("config_settings", {})
    if not isinstance(settings_table, dict):
        raise SpecError(f"{source}: install.config_settings must be a table of variants")
    config_settings: dict[str, tuple[str, ...]] = {}
    for variant, settings in settings_table.items():
        if variant not in packages:
            raise SpecError(f"{source}: install.config_settings.{variant}: the spec has no such variant")
        if not isinstance(settings, list) or not all(
            isinstance(s, str) and _CONFIG_SETTING.match(s) for s in settings
        ):
            raise SpecError(
                f"{source}: install.config_settings.{variant} must be a list of KEY=VALUE strings"
            )
        config_settings[variant] = tuple(settings)
    builds_from_source = install.get("builds_from_source", "")
    if not isinstance(builds_from_source, str):
        raise SpecError(f"{source}: install.builds_from_source must be a string")
    env_drop = server.get("env_drop", [])
    if not isinstance(env_drop, list) or not all(isinstance(n, str) and n for n in env_drop):
        raise SpecError(f"{source}: server.env_drop must be a list of variable names")

    def number(table: dict[str, Any], key: str, default: float, where: str) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{source}: {where}{key} must be a number")
        return value

    def flag(table: dict[str, Any], key: str, default: bool, where: str) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{source}: {where}{key} must be true or false")
        return value

    nonstream = data.get("nonstream", {})
    if not isinstance(nonstream, dict):
        raise SpecError(f"{source}: nonstream must be a table")
    cannot_carry = nonstream.get("stream_cannot_carry", [])
    if not isinstance(cannot_carry, list) or not all(isinstance(n, str) and n for n in cannot_carry):
        raise SpecError(f"{source}: nonstream.stream_cannot_carry must be a list of field names")

    spec = EngineSpec(
        name=need(data, "name", str, ""),
        kind=need(data, "kind", str, ""),
        version=need(data, "version", str, ""),
        summary=str(data.get("summary", "")),
        model_formats=tuple(need(data, "model_formats", list, "")),
        packages=packages,
        argv=tuple(argv),
        http_version=str(server.get("http_version", "1.1")),
        batch_size=int(number(server, "batch_size", 1, "server.")),
        readiness=Readiness(
            path=need(readiness, "path", str, "readiness."),
            max_tokens=int(number(readiness, "max_tokens", 1, "readiness.")),
            timeout_s=float(number(readiness, "timeout_s", 600.0, "readiness.")),
            health_path=health_path,
            probe_interval_s=float(number(readiness, "probe_interval_s", 60.0, "readiness.")),
            probe_timeout_s=float(number(readiness, "probe_timeout_s", 300.0, "readiness.")),
        ),
        model_field=mode,
        guards=Guards(
            min_max_tokens=int(number(guards, "min_max_tokens", 1, "guards.")),
            require_input=flag(guards, "require_input", False, "guards."),
            check_types=flag(guards, "check_types", False, "guards."),
            seed_min=None if "seed_min" not in guards else int(number(guards, "seed_min", 0, "guards.")),
            top_logprobs_max=int(number(guards, "top_logprobs_max", 20, "guards.")),
            completion_logprobs=_choice(guards, "completion_logprobs", ("count", "flag"), source),
        ),
        config_settings=config_settings,
        env_drop=tuple(env_drop),
        builds_from_source=builds_from_source,
        nonstream=NonStream(
            via_stream=flag(nonstream, "via_stream", False, "nonstream."),
            stream_cannot_carry=tuple(cannot_carry),
        ),
    )
    if source.endswith(".toml") and spec.name != source.removesuffix(".toml"):
        raise SpecError(f"{source}: name {spec.name!r} does not match the file name")
    return spec
