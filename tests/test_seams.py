"""Where the composition root copies between engines and the request path by field name: both sides agree."""

from __future__ import annotations

import dataclasses

from engines import spec as specs
from proxy.payload import RequestGuards
from proxy.relay import RelaySettings
from proxy.startup.catalog import _guards
from proxy.startup.settings import Settings, relay_settings


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_spec_tables_fill_every_request_guard_and_nothing_else() -> None:
    assert names(specs.Guards).isdisjoint(names(specs.NonStream))
    assert names(specs.Guards) | names(specs.NonStream) == names(RequestGuards)


def test_a_spec_without_guards_gives_the_relays_defaults() -> None:
    assert RequestGuards(**dataclasses.asdict(specs.Guards()), **dataclasses.asdict(specs.NonStream())) == (
        RequestGuards()
    )


def test_a_shipped_spec_reaches_the_relay_field_for_field() -> None:
    spec = specs.load("mlx-0.32.0")
    guards = _guards(spec)
    for table in (spec.guards, spec.nonstream):
        for f in dataclasses.fields(table):
            assert getattr(guards, f.name) == getattr(table, f.name)
    assert guards.require_input and guards.via_stream  # what mlx needs, not the defaults


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
