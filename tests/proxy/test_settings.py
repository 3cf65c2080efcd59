"""proxy.startup.settings and options: each setting's flag, variable and default come from one field."""

from __future__ import annotations

import dataclasses

import click
import pytest

from proxy.startup.cli import main
from proxy.startup.options import settings_from
from proxy.startup.settings import Settings, flags


def options() -> dict[str, click.Option]:
    return {p.name: p for p in main.params if isinstance(p, click.Option) and p.name is not None}


def test_every_flagged_field_is_an_option_with_its_variable_and_default() -> None:
    found, defaults = options(), Settings()
    assert [name for name, _ in flags()] == [n for n in found if n not in ("version", "help")]
    for name, flag in flags():
        option = found[name]
        assert flag.long in option.opts
        assert option.envvar == flag.envvar
        if flag.commas:
            assert option.default == ",".join(getattr(defaults, name))
        elif not flag.multiple:
            assert option.default == getattr(defaults, name)


def test_the_variables_are_the_flags_names() -> None:
    names = dict(flags())
    assert names["heartbeat_s"].envvar == "BLAZAR_SSE_HEARTBEAT"
    assert names["metrics"].envvar == "BLAZAR_METRICS"
    assert names["upstreams"].envvar == "BLAZAR_UPSTREAM"


def test_only_the_routes_are_not_a_flag() -> None:
    assert {f.name for f in dataclasses.fields(Settings)} - {name for name, _ in flags()} == {"routes"}


def test_click_values_become_settings() -> None:
    given = {name: getattr(Settings(), name) for name, _ in flags()}
    given.update(
        forwarded_allow_ips=" 10.0.0.1, ,10.0.0.2",
        allowed_hosts="llm.example.com,*",
        api_keys=["a", "b"],
        port=9,
    )
    settings = settings_from(given)
    assert settings.forwarded_allow_ips == ("10.0.0.1", "10.0.0.2")
    assert settings.allowed_hosts == ("llm.example.com", "*")
    assert settings.api_keys == ("a", "b")
    assert settings.port == 9


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "'70000' is not a port number; give 1-65535, or 0 for any free port"),
        (["--connect-timeout", "0"], "'0' is too small; give more than 0"),
        (["--max-header-bytes", "10"], "'10' is too small; give 1024 or more"),
        (["--engine-variant", "rocm"], "'rocm' is not one of 'auto', 'cpu', 'cuda12', 'cuda13', 'metal'"),
        (["--log-format", "xml"], "'xml' is not one of 'text', 'json'"),
    ],
)
def test_each_option_checks_its_value_by_the_fields_flag(args: list[str], message: str) -> None:
    with pytest.raises(click.BadParameter, match=message.replace("(", r"\(").replace(")", r"\)")):
        main.make_context("blazar-proxy", args)
