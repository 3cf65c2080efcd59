"""Where the composition root hands engines' objects to the request path: both sides agree."""

from __future__ import annotations

import dataclasses

import pytest

from engines import spec as specs
from proxy.errors import HTTPError
from proxy.payload import RequestGuards, ask_for_stream, check_request
from proxy.relay import RelaySettings
from proxy.routing import Route
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import ModelConfig
from proxy.startup.settings import Settings, relay_settings
from tests.engines.test_spec import shipped_table


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_guard_the_spec_defines_is_one_the_request_path_reads() -> None:
    """The spec's one Guards and the relay's RequestGuards protocol name the same guards: none is dead."""
    read = {name for name, member in vars(RequestGuards).items() if isinstance(member, property)}
    assert read == names(specs.Guards)


def test_a_route_with_no_engine_gets_what_a_spec_without_guards_gets() -> None:
    """A static upstream's route carries the defaults a spec with no [guards] or [nonstream] table has."""
    route = Catalog(home=None, registry=None).prepare(
        ModelConfig(name="m", upstream="http://127.0.0.1:9001/v1", source="--upstream m=...")
    )
    assert isinstance(route, Route)
    data = shipped_table()
    del data["guards"], data["nonstream"]
    bare = specs.parse(data, source="mlx-0.32.0.toml")
    assert route.guards == bare.guards == specs.Guards()


def test_a_shipped_spec_s_guards_are_the_relay_s_checks() -> None:
    """mlx's spec object, handed straight through, is what the request path checks with (it is hashable)."""
    guards = specs.load("mlx-0.32.0").guards
    assert guards.require_input and guards.via_stream  # what mlx needs, not the defaults
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": -1}
    with pytest.raises(HTTPError) as info:
        check_request(doc, b"/chat/completions", guards)
    assert info.value.param == "seed"  # seed_min 0: mlx refuses negative seeds
    assert check_request({**doc, "seed": -1}, b"/chat/completions", specs.Guards(check_types=True)) is False
    assert not ask_for_stream({"model": "m", "logprobs": True}, b"/chat/completions", guards)


def test_every_relay_setting_is_a_gateway_setting_with_the_relays_default() -> None:
    given = names(RelaySettings) - {"strip_credentials"}
    assert given <= names(Settings)
    assert relay_settings(Settings()) == RelaySettings()


def test_the_relay_gets_what_the_gateway_was_told() -> None:
    told = Settings(first_byte_timeout_s=9.0, max_queued=3, forwarded_allow_ips=("10.0.0.1",))
    relay = relay_settings(told, strip_credentials=True)
    assert (relay.first_byte_timeout_s, relay.max_queued, relay.forwarded_allow_ips) == (
        9.0,
        3,
        ("10.0.0.1",),
    )
    assert relay.strip_credentials
