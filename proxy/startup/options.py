"""The click options of ``blazar-proxy``, built from the settings' flags (proxy/startup/settings.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from proxy.startup.settings import Flag, Settings, flags

F = TypeVar("F", bound=Callable[..., Any])


def click_type(flag: Flag, default: object) -> click.ParamType[Any] | None:
    """The click type that checks one flag's value: its choices, its range, or a file path."""
    kind = flag.kind or type(default)
    if flag.off:
        return IntOrOff(int(flag.low or 0))
    if flag.choices:
        return click.Choice(flag.choices)
    if kind is Path:
        return click.Path(exists=flag.exists, dir_okay=False, path_type=Path)
    if kind is int and flag.low is not None:
        return click.IntRange(int(flag.low), None if flag.high is None else int(flag.high))
    if kind is float and flag.low is not None:
        return click.FloatRange(flag.low, flag.high, min_open=flag.low_open)
    return None


class IntOrOff(click.ParamType[int | None]):
    """An integer of at least ``low``, or ``off`` (None)."""

    name = "N|off"

    def __init__(self, low: int) -> None:
        self.low = low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{value!r} is neither a whole number nor off", param, ctx)
        if isinstance(value, int):
            number = value
        elif str(value).strip().lower() == "off":
            return None
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is neither a whole number nor off", param, ctx)
        if number < self.low:
            self.fail(f"{number} is below {self.low}", param, ctx)
        return number


def option(name: str, flag: Flag, default: object, **extra: Any) -> Callable[[F], F]:
    """One setting as a click option: the flag, BLAZAR_* variable, type, default and help."""
    if flag.commas:
        assert isinstance(default, tuple)
        default = ",".join(default)
    elif flag.multiple:
        default = None
    kwargs: dict[str, Any] = {
        "default": default,
        "envvar": flag.envvar,
        "show_envvar": True,
        "help": flag.help,
        "multiple": flag.multiple,
    }
    kind = click_type(flag, default)
    if kind is not None:
        kwargs["type"] = kind
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    kwargs.update(extra)
    return click.option(flag.decls, name, **kwargs)


def gateway_options(extra: Mapping[str, Mapping[str, Any]]) -> Callable[[F], F]:
    """All of the settings' options, in ``--help``'s order; ``extra`` adds click arguments by name."""
    defaults = Settings()
    decorators = [
        option(name, flag, getattr(defaults, name), **extra.get(name, {})) for name, flag in flags()
    ]

    def apply(command: F) -> F:
        for decorate in reversed(decorators):
            command = decorate(command)
        return command

    return apply


def settings_from(given: Mapping[str, Any]) -> Settings:
    """The settings from click's values (a comma list split, repeated values as tuples)."""
    values = dict(given)
    for name, flag in flags():
        if flag.commas:
            values[name] = tuple(item.strip() for item in values[name].split(",") if item.strip())
        elif flag.multiple:
            values[name] = tuple(values[name])
    return Settings(**values)
