"""The configuration file (``--config blazar.toml``): gateway settings and the models.

Read and checked whole before anything starts: an error names the file, the
key and the reason, and the gateway does not start (on a reload, the running
configuration stays). The ``[gateway]`` table holds the command-line options
by their long names; the command line and the environment win over it
(click's ``default_map`` gives exactly that order). Each ``[models.NAME]``
table is one model::

    [gateway]
    port = 8000
    max-loaded = 2

    [models.qwen]
    engine = "auto"              # or "mlx-0.32.0", "llamacpp-…"
    model = "~/models/qwen-mlx"  # a directory, a .gguf file, or a hub repo
    aliases = ["gpt-4o-mini"]
    replicas = 2
    engine-args = ["--max-tokens", "1024"]
    allow-fields = ["adapters"]  # request fields that load something, allowed
    max-tokens = 1024            # the most tokens a request may ask for, on every API
    ttl = 600                    # seconds idle before unloading; 0: never
    always-loaded = false

    [models.remote]
    upstream = "http://10.0.0.5:8000/v1"
    native-apis = ["messages", "responses"]  # it serves these itself: passed through
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.spec import NATIVE_APIS, VARIANT_CHOICES
from proxy.routing import UpstreamSpecError, parse_upstream_url


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file, the key and why."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model's settings, from the file or the command line.

    Compared as a whole on a reload: a model whose ``ModelConfig`` is equal
    to the running one is left alone.
    """

    # None only for the command line's --engine model: named after its directory.
    name: str | None
    engine: str | None = None
    model: str | None = None
    upstream: str | None = None
    # A replica set: every server's URL (``upstream`` is the first), or () for one server.
    upstreams: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    replicas: int = 1
    engine_args: tuple[str, ...] = ()
    ttl_s: float = 0.0
    always_loaded: bool = False
    max_in_flight: int | None = None
    variant: str = "auto"
    # Request fields that make the engine load what they name (mlx: draft_model,
    # adapters), allowed for this model; refused otherwise.
    allow_fields: tuple[str, ...] = ()
    # The most tokens a request may ask it to generate, on every API; None: no cap.
    max_tokens: int | None = None
    # The APIs besides chat completions its server serves itself; None: its engine's spec says.
    native_apis: tuple[str, ...] | None = None
    # Where it was given, for error messages; not a setting (a reload ignores it).
    source: str = field(default="", compare=False)

    def where(self, key: str) -> str:
        """Where setting ``key`` was given, to start an error message with.

        ``FILE: [models.NAME] key`` for the file; for the command line's
        ``--engine`` model, the flag and its value (``--model ./x``).
        """
        flag = _FLAGS.get(key)
        if flag is not None and self.source.startswith("--engine"):
            return f"{flag} {getattr(self, key)}"
        return f"{self.source} {key}" if self.source else key


# The command line's flags for the --engine model's settings.
_FLAGS = {"engine": "--engine", "model": "--model", "variant": "--engine-variant", "name": "--served-name"}


@dataclass(frozen=True, slots=True)
class FileConfig:
    path: Path
    # Option name → value, for click's default_map.
    gateway: Mapping[str, Any] = field(default_factory=dict)
    models: tuple[ModelConfig, ...] = ()


# Model keys: the file's spelling → (field, check).
def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value.strip()


def _strings(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a list of non-empty strings, got {value!r}")
    return tuple(value)


def _count(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected a whole number of at least 1, got {value!r}")
    return value


def _seconds(where: str, value: Any) -> float:
    # "not >= 0" also refuses NaN, which compares false with everything.
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{where}: expected seconds (a number, 0 or more), got {value!r}")
    return float(value)


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _urls(where: str, value: Any) -> str | tuple[str, ...]:
    """One server's URL, or a list of them (a replica set)."""
    if isinstance(value, str):
        return _string(where, value)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f'{where}: expected a URL or a list of URLs (["http://a:8000", …]), got {value!r}')
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: a URL is given twice")
    return value[0] if len(value) == 1 else tuple(value)


def _apis(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(v in NATIVE_APIS for v in value):
        raise ConfigError(
            f"{where}: expected a list of the APIs the server serves itself, of {', '.join(NATIVE_APIS)}; "
            f"got {value!r}"
        )
    return tuple(value)


def _variant(where: str, value: Any) -> str:
    if value not in VARIANT_CHOICES:
        raise ConfigError(f"{where}: expected one of {', '.join(VARIANT_CHOICES)}, got {value!r}")
    return str(value)


_MODEL_KEYS: Mapping[str, tuple[str, Callable[[str, Any], Any]]] = {
    "engine": ("engine", _string),
    "model": ("model", _string),
    "upstream": ("upstream", _urls),
    "aliases": ("aliases", _strings),
    "replicas": ("replicas", _count),
    "engine_args": ("engine_args", _strings),
    "ttl": ("ttl_s", _seconds),
    "always_loaded": ("always_loaded", _flag),
    "max_in_flight": ("max_in_flight", _count),
    "variant": ("variant", _variant),
    "allow_fields": ("allow_fields", _strings),
    "max_tokens": ("max_tokens", _count),
    "native_apis": ("native_apis", _apis),
}


def load(path: Path, check_gateway: Callable[[str, Any], tuple[str, Any]]) -> FileConfig:
    """Read and check ``path``.

    ``check_gateway(key, value)`` turns one ``[gateway]`` entry into
    ``(option name, value)`` or raises ``ValueError`` saying why not (the
    command line knows its options; this module does not).
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"gateway", "models"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown table {sorted(unknown)[0]!r}; the file has [gateway] and [models.NAME]"
        )
    gateway_table = data.get("gateway", {})
    if not isinstance(gateway_table, dict):
        raise ConfigError(f"{path}: gateway: expected a table [gateway]")
    gateway: dict[str, Any] = {}
    for key, value in gateway_table.items():
        try:
            name, converted = check_gateway(key, value)
        except ValueError as exc:
            raise ConfigError(f"{path}: [gateway] {key}: {exc}") from None
        gateway[name] = converted
    models_table = data.get("models", {})
    if not isinstance(models_table, dict):
        raise ConfigError(f"{path}: models: expected tables [models.NAME]")
    models = tuple(_model(path, name, table) for name, table in models_table.items())
    check_names(models, str(path))
    return FileConfig(path=path, gateway=gateway, models=models)


def _model(path: Path, name: str, table: Any) -> ModelConfig:
    where = f"{path}: [models.{_quoted(name)}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of settings, got {table!r}")
    if not name.strip() or name != name.strip():
        raise ConfigError(f"{where}: a model name must be non-empty, without surrounding spaces")
    values: dict[str, Any] = {"name": name, "source": where}
    for key, value in table.items():
        spec = _MODEL_KEYS.get(key.replace("-", "_"))
        if spec is None:
            raise ConfigError(f"{where} {key}: unknown key{_did_you_mean(key, _MODEL_KEYS)}")
        attr, check = spec
        values[attr] = check(f"{where} {key}", value)
    if isinstance(values.get("upstream"), tuple):
        values["upstreams"] = values["upstream"]
        values["upstream"] = values["upstreams"][0]
    config = ModelConfig(**values)
    if config.engine is None and config.upstream is None:
        raise ConfigError(f"{where}: give engine (with model), or upstream")
    if config.upstream is not None:
        # With an upstream, engine names the engine that server runs: its
        # spec's request checks and non-stream handling apply to it too.
        if config.engine == "auto":
            raise ConfigError(
                f'{where} engine: "auto" picks an engine from a model\'s files, and an upstream has none '
                "here: name the engine the upstream runs (blazar-proxy engines list), or leave engine out"
            )
        try:
            for url in config.upstreams or (config.upstream,):
                parse_upstream_url(url)
        except UpstreamSpecError as exc:
            raise ConfigError(f"{where} upstream: {exc}") from None
        for key in table:
            if key.replace("-", "_") in ("model", "engine_args", "ttl", "always_loaded", "variant"):
                raise ConfigError(f"{where} {key}: only for engine models, not for an upstream")
        if config.replicas != 1:
            raise ConfigError(
                f"{where} replicas: an upstream is one server; "
                'for several, list their URLs: upstream = ["http://a:8000", "http://b:8000"]'
            )
    elif config.engine == "auto" and config.model is None:
        raise ConfigError(f'{where} engine: "auto" picks the engine from the model, so model is needed')
    if config.always_loaded and config.ttl_s:
        raise ConfigError(f"{where} ttl: an always-loaded model is never unloaded; drop one of the two")
    return config


def check_names(models: tuple[ModelConfig, ...], where: str) -> None:
    """No name or alias may serve two models."""
    seen: dict[str, str] = {}
    for config in models:
        if config.name is None:
            continue
        for name in (config.name, *config.aliases):
            if name in seen:
                raise ConfigError(
                    f"{where}: model name {name!r} is used by both {seen[name]!r} and {config.name!r}"
                )
            seen[name] = config.name


def _quoted(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else f'"{name}"'


def _did_you_mean(key: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1)
    choices = ", ".join(k.replace("_", "-") for k in known)
    return f" (did you mean {close[0].replace('_', '-')!r}?)" if close else f" (known: {choices})"
