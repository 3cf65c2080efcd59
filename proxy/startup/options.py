"""The click options of ``blazar-proxy``, built from the settings' flags (proxy/startup/settings.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from proxy.startup.configfile import FileConfig
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
        high = None if flag.high is None else int(flag.high)
        return WholeNumber(int(flag.low), high, _NOUNS.get(flag.long, "a whole number"))
    if kind is float and flag.low is not None:
        return Number(flag.low, flag.high, low_open=flag.low_open)
    return None


# What an integer option's value is, where "a whole number" says too little.
_NOUNS = {"--port": "a port number"}


class BadValue(click.BadParameter):
    """A bad value, said as ``--flag: what is wrong; what to give``, naming where it was given."""

    def format_message(self) -> str:
        if self.param is None or self.ctx is None:
            return self.message
        return f"{given_as(self.ctx, self.param)}: {self.message}"


class WholeNumber(click.IntRange):
    """An integer from ``low`` (to ``high``), refused in words that say what to give.

    click's own wording names the variable whatever gave the value, and the type
    ("is not a valid integer range"); this one says what the value is not and
    what would do.
    """

    def __init__(self, low: int, high: int | None = None, noun: str = "a whole number") -> None:
        super().__init__(low, high)
        self.noun = noun
        if noun == "a port number" and low == 0:
            self.wanted = f"give 1-{high}, or 0 for any free port"
        elif high is None:
            self.wanted = f"give {low} or more"
        else:
            self.wanted = f"give {low}-{high}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number: int = super().convert(value, param, ctx)
        except click.BadParameter:
            # A whole number out of the range is told which way (a port, only what to give).
            given = int(value) if self.noun == "a whole number" and _is_integer(value) else None
            raise BadValue(_refused(value, given, self.noun, self.wanted, self.min), ctx, param) from None
        return number


class Number(click.FloatRange):
    """A number (the settings' are seconds) from ``low`` (to ``high``), refused as ``WholeNumber`` is."""

    def __init__(self, low: float, high: float | None = None, low_open: bool = False) -> None:
        super().__init__(low, high, min_open=low_open)
        least = f"more than {low:g}" if low_open else f"{low:g} or more"
        self.wanted = f"give {least}" if high is None else f"give {low:g}-{high:g}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number: float = super().convert(value, param, ctx)
        except click.BadParameter:
            try:
                given: float | None = float(str(value))
            except ValueError:
                given = None
            raise BadValue(_refused(value, given, "a number", self.wanted, self.min), ctx, param) from None
        return number


def _refused(value: object, given: float | None, noun: str, wanted: str, low: float | None) -> str:
    """Why a range refused ``value`` (``given``: it as a number, None if it is not one), and what to give."""
    if given is None:
        return f"{value!r} is not {noun}; {wanted}"
    # At the low end, in a range open there (x>0), the bound itself is too small.
    wrong = "too small" if low is not None and given <= low else "too large"
    return f"{value!r} is {wrong}; {wanted}"


def _is_integer(value: object) -> bool:
    try:
        int(str(value))
    except ValueError:
        return False
    return not isinstance(value, bool)


def given_as(ctx: click.Context, param: click.Parameter) -> str:
    """How ``param`` was set, to say which one to change: its flag, its variable or the file's key."""
    flag = next((o for o in param.opts if o.startswith("--")), param.human_readable_name)
    key = flag.removeprefix("--")
    variable = param.envvar if isinstance(param.envvar, str) else f"BLAZAR_{key.upper().replace('-', '_')}"
    source = ctx.get_parameter_source(param.name) if param.name else None
    if source is ParameterSource.COMMANDLINE:
        return flag
    if source is ParameterSource.ENVIRONMENT:
        return variable
    if source is ParameterSource.DEFAULT_MAP:
        config: FileConfig | None = ctx.params.get("config_file")
        return f"{key} in {config.path if config else 'the config file'}'s [gateway] table"
    return f"{flag} (or {variable}, or {key} in a config file's [gateway])"


class IntOrOff(click.ParamType[int | None]):
    """An integer of at least ``low``, or ``off`` (None)."""

    name = "N|off"

    def __init__(self, low: int) -> None:
        self.low = low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None:
            return None
        wanted = f"give {self.low} or more, or off"
        if isinstance(value, bool):
            raise BadValue(f"{value!r} is neither a whole number nor off; {wanted}", ctx, param)
        if isinstance(value, int):
            number = value
        elif str(value).strip().lower() == "off":
            return None
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                raise BadValue(f"{value!r} is neither a whole number nor off; {wanted}", ctx, param) from None
        if number < self.low:
            raise BadValue(f"{value!r} is too small; {wanted}", ctx, param)
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
