"""Engine versions as data: one TOML file per version in ``engines/specs/``.

Adding ``mlx-0.31.x`` or a new engine version is adding a file; nothing here
knows about any particular engine.
"""

from __future__ import annotations

import string
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

VARIANTS = ("cpu", "cuda12", "cuda13", "metal")
CUDA_VARIANTS = frozenset({"cuda12", "cuda13"})
MODEL_FIELD_MODES = frozenset({"run-dir-symlink"})
_PLACEHOLDERS = frozenset({"python", "model", "host", "port"})


class SpecError(ValueError):
    """An engine spec that is missing, malformed or inconsistent."""


@dataclass(frozen=True, slots=True)
class Readiness:
    path: str
    max_tokens: int
    timeout_s: float
    health_path: str
    probe_interval_s: float = 60.0
    probe_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Guards:
    """Request checks the gateway makes because the engine breaks on them."""

    min_max_tokens: int = 1
    require_input: bool = False


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

    def packages_for(self, variant: str) -> tuple[str, ...]:
        try:
            return self.packages[variant]
        except KeyError:
            raise SpecError(
                f"engine {self.name} has no {variant!r} variant; it has {', '.join(self.packages)}"
            ) from None

    def server_argv(self, *, python: str, model: str, host: str, port: int) -> list[str]:
        """The child's command line, with the template's placeholders filled."""
        values = {"python": python, "model": model, "host": host, "port": str(port)}
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
    unknown = {
        name for part in argv for _, name, _, _ in string.Formatter().parse(part) if name
    } - _PLACEHOLDERS
    if unknown:
        raise SpecError(f"{source}: server.argv has unknown placeholders {sorted(unknown)}")

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
            health_path=str(readiness.get("health_path", "")),
            probe_interval_s=float(number(readiness, "probe_interval_s", 60.0, "readiness.")),
            probe_timeout_s=float(number(readiness, "probe_timeout_s", 300.0, "readiness.")),
        ),
        model_field=mode,
        guards=Guards(
            min_max_tokens=int(number(guards, "min_max_tokens", 1, "guards.")),
            require_input=flag(guards, "require_input", False, "guards."),
        ),
    )
    if source.endswith(".toml") and spec.name != source.removesuffix(".toml"):
        raise SpecError(f"{source}: name {spec.name!r} does not match the file name")
    return spec
