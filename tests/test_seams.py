"""Where the composition root hands engines' objects to the request path: both sides agree."""

from __future__ import annotations

import ast
import dataclasses
import typing

import pytest

from engines import spec as specs
from proxy.auth import ApiKeys
from proxy.errors import HTTPError
from proxy.payload import RequestGuards, ask_for_stream, check_request
from proxy.relay import RelaySettings
from proxy.routing import Route
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import ModelConfig
from proxy.startup.settings import Settings, flags
from tests.engines.test_spec import shipped_table
from tests.helpers import ROOT


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def reads(protocol: type) -> set[str]:
    """The read-only properties a protocol declares: what its reader reads. Read from its source: a
    protocol class in a compiled module keeps none of its members at run time."""
    source = ROOT / (protocol.__module__.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == protocol.__name__:
            return {
                f.name
                for f in node.body
                if isinstance(f, ast.FunctionDef)
                and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
            }
    raise AssertionError(f"no class {protocol.__name__} in {source}")


def test_every_guard_the_spec_defines_is_one_the_request_path_reads() -> None:
    """The spec's one Guards and the relay's RequestGuards protocol name the same guards: none is dead."""
    assert reads(RequestGuards) == names(specs.Guards)


def test_a_route_with_no_engine_gets_what_a_spec_without_guards_gets() -> None:
    """A static upstream's route carries the defaults a spec with no [guards] or [nonstream] table has."""
    route = Catalog(home=None, registry=None).prepare(
        ModelConfig(name="m", upstream="http://127.0.0.1:9001/v1", source="--upstream m=...")
    )
    assert isinstance(route, Route)
    data = shipped_table()
    del data["guards"], data["nonstream"], data["fields"], data["completion_fields"]
    bare = specs.parse(data, source="mlx-0.32.0.toml")
    assert route.guards == bare.guards == specs.Guards()


def test_a_shipped_spec_s_guards_are_the_relay_s_checks() -> None:
    """mlx's spec object, handed straight through, is what the request path checks with (it is hashable)."""
    guards = specs.load("mlx-0.32.0").guards
    assert guards.require_input and guards.via_stream  # what mlx needs, not the defaults
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": -1}
    with pytest.raises(HTTPError) as info:
        check_request(doc, b"/chat/completions", guards)
    assert info.value.param == "seed"  # [fields] seed min 0: mlx refuses negative seeds
    assert check_request({**doc, "seed": -1}, b"/chat/completions", specs.Guards()) == ()
    assert not ask_for_stream({"model": "m", "logprobs": True}, b"/chat/completions", guards)


def test_every_setting_the_relay_reads_is_a_gateway_setting_of_the_same_type() -> None:
    """The relay's protocol names only Settings' fields, each with its flag and type; no defaults."""
    read = reads(RelaySettings)
    assert "max_body_bytes" in read and "health_interval_s" in read  # the protocol is what is read
    derived = {"strip_credentials"}
    assert read - derived <= {name for name, _ in flags()}
    given = typing.get_type_hints(Settings)
    for name in read - derived:
        assert typing.get_type_hints(getattr(RelaySettings, name).fget)["return"] == given[name], name
    assert typing.get_type_hints(vars(Settings)["strip_credentials"].fget)["return"] is bool


def test_the_relay_reads_what_the_gateway_was_told_from_the_gateway_s_own_object() -> None:
    told = Settings(first_byte_timeout_s=9.0, max_queued=3, forwarded_allow_ips=("10.0.0.1",))
    relay: RelaySettings = told  # what the composition root hands over, as it is
    assert (relay.first_byte_timeout_s, relay.max_queued, relay.forwarded_allow_ips) == (
        9.0,
        3,
        ("10.0.0.1",),
    )


def test_the_relay_strips_the_client_s_credentials_exactly_when_the_gateway_checks_keys() -> None:
    """Derived from the keys by the rule the gateway checks them with: a blank key is none."""
    assert not Settings().strip_credentials
    assert Settings(api_keys=("k",)).strip_credentials
    for keys in [(), ("k",), ("  ",), ("", "k")]:
        assert Settings(api_keys=keys).strip_credentials == bool(ApiKeys(keys)), keys
