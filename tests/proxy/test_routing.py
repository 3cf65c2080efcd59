"""proxy.routing: upstream URLs, NAME=URL specs and the routing table."""

from __future__ import annotations

import pytest

from engines.spec import Guards
from proxy.routing import (
    Route,
    RoutingTable,
    UpstreamAddress,
    UpstreamSpecError,
    parse_upstream_spec,
    parse_upstream_url,
)


def route(spec: str) -> Route:
    """A route from NAME=URL, as the catalog makes one for a server with no engine named."""
    name, upstream = parse_upstream_spec(spec)
    return Route(model=name, upstream=upstream, guards=Guards())


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080",
        "http://127.0.0.1:8080/",
        "http://127.0.0.1:8080/v1",
        "http://127.0.0.1:8080/v1/",
        "  http://127.0.0.1:8080/v1  ",
    ],
)
def test_base_url_with_or_without_v1_means_the_same_server(url: str) -> None:
    """A base URL with or without /v1 and a trailing slash gives the same address with no prefix."""
    assert parse_upstream_url(url) == UpstreamAddress(host="127.0.0.1", port=8080, prefix="")


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        ("http://h:1/api/v1", "/api"),
        ("http://h:1/api/v1/", "/api"),
        ("http://h:1/api", "/api"),
        ("http://h:1/a/b/v1", "/a/b"),
        ("http://h:1/v1x", "/v1x"),
    ],
)
def test_path_before_v1_is_the_prefix(url: str, prefix: str) -> None:
    """The path before /v1 (or the whole path without /v1) is kept as the prefix."""
    assert parse_upstream_url(url).prefix == prefix


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8000/v1/chat/completions", "http://127.0.0.1:8000/v1"),
        ("http://h:1/v1/completions/", "http://h:1/v1"),
        ("http://h:1/api/v1/embeddings", "http://h:1/api/v1"),
    ],
)
def test_an_endpoint_url_is_refused_with_its_base(url: str, base: str) -> None:
    """A URL copied from a request (it names the endpoint) is refused, and the message gives its base."""
    with pytest.raises(UpstreamSpecError, match="names an endpoint") as raised:
        parse_upstream_url(url)
    assert str(raised.value).endswith(f": {base}")


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "localhost:8080/v1"])
def test_a_url_without_a_scheme_is_refused_with_the_fix(url: str) -> None:
    with pytest.raises(UpstreamSpecError, match=f"has no scheme: write http://{url}$"):
        parse_upstream_url(url)


def test_prefix_goes_into_target_and_base_url() -> None:
    """UpstreamAddress.target and base_url put the prefix before /v1."""
    address = parse_upstream_url("http://h:1/api/v1")
    assert address.target(b"/chat/completions") == b"/api/v1/chat/completions"
    assert address.base_url == "http://h:1/api/v1"


def test_target_without_prefix() -> None:
    """Without a prefix, the target is /v1 plus the endpoint."""
    assert UpstreamAddress("h", 1).target(b"/completions") == b"/v1/completions"


def test_default_port_is_80() -> None:
    """An http URL without a port means port 80, written out in the Host header."""
    address = parse_upstream_url("http://engine.local/v1")
    assert (address.host, address.port) == ("engine.local", 80)
    assert address.host_header == b"engine.local:80"


def test_host_is_lower_cased() -> None:
    """The host name is case-insensitive and stored lower-case."""
    assert parse_upstream_url("http://Engine.LOCAL:9000").host == "engine.local"


def test_scheme_is_case_insensitive() -> None:
    """HTTP:// is the same scheme as http://."""
    assert parse_upstream_url("HTTP://h:1").port == 1


def test_ipv6_literal_is_bracketed_in_host_header() -> None:
    """An IPv6 literal is stored bare and written bracketed in Host and base_url."""
    address = parse_upstream_url("http://[::1]:8080/v1")
    assert (address.host, address.port) == ("::1", 8080)
    assert address.host_header == b"[::1]:8080"
    assert address.base_url == "http://[::1]:8080/v1"


def test_ipv4_host_header_is_not_bracketed() -> None:
    """An IPv4 address goes into Host as it is."""
    assert parse_upstream_url("http://10.0.0.2:81").host_header == b"10.0.0.2:81"


@pytest.mark.parametrize(
    "url",
    [
        "https://h:443/v1",
        "ftp://h/v1",
        "h:8080",
        "127.0.0.1:8080",
        "",
        "http://",
        "http:///v1",
        "http://:8080/v1",
        "http://h:1/v1?key=x",
        "http://h:1/v1#frag",
        "http://user:pass@h:1/v1",
        "http://user@h:1/v1",
        "http://h:99999",
        "http://h:port",
        "http://h:-1",
    ],
)
def test_unusable_urls_are_rejected(url: str) -> None:
    """TLS, other schemes, missing host, query, fragment, credentials and bad ports are UpstreamSpecError."""
    with pytest.raises(UpstreamSpecError):
        parse_upstream_url(url)


@pytest.mark.parametrize("url", ["http://[::1:8080/v1", "http://[not-an-ip]:8080"])
def test_malformed_bracketed_host_is_upstream_spec_error(url: str) -> None:
    """A malformed bracketed host is reported as UpstreamSpecError, like any other bad URL."""
    with pytest.raises(UpstreamSpecError):
        parse_upstream_url(url)


def test_port_zero_is_rejected() -> None:
    """Port 0 cannot be connected to, so it is rejected instead of becoming port 80."""
    with pytest.raises(UpstreamSpecError):
        parse_upstream_url("http://h:0/v1")


@pytest.mark.parametrize("url", ["http://exämple:8080/v1", "http://bad host:8080/v1"])
def test_host_not_usable_in_a_host_header_is_rejected_at_parse_time(url: str) -> None:
    """A host that cannot be written as an ASCII Host header fails at startup, not on each request."""
    with pytest.raises(UpstreamSpecError):
        parse_upstream_url(url)


def test_spec_name_equals_url() -> None:
    """NAME=URL gives NAME and the parsed URL."""
    assert parse_upstream_spec("qwen=http://127.0.0.1:8080/v1") == (
        "qwen",
        UpstreamAddress("127.0.0.1", 8080),
    )


def test_spec_name_may_contain_slashes() -> None:
    """Hub-style names like org/name are valid model names."""
    name, upstream = parse_upstream_spec("mlx-community/Qwen2.5-0.5B-Instruct-4bit=http://h:1")
    assert name == "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    assert upstream == UpstreamAddress("h", 1)


def test_spec_splits_on_first_equals_and_trims_the_name() -> None:
    """The name is trimmed and ends at the first '='."""
    name, upstream = parse_upstream_spec(" qwen =http://h:1/api/v1")
    assert name == "qwen"
    assert upstream.prefix == "/api"


@pytest.mark.parametrize(
    "spec",
    ["http://h:1", "qwen", "=http://h:1", "  =http://h:1", "qwen=", "qwen=  ", ""],
)
def test_spec_without_name_or_url_is_rejected(spec: str) -> None:
    """A spec without '=', with an empty name or an empty URL is UpstreamSpecError."""
    with pytest.raises(UpstreamSpecError, match="expected NAME=URL"):
        parse_upstream_spec(spec)


def test_spec_with_bad_url_is_rejected() -> None:
    """A spec whose URL is unusable is UpstreamSpecError."""
    with pytest.raises(UpstreamSpecError, match="only http://"):
        parse_upstream_spec("qwen=https://h:1")


def test_upstream_spec_error_is_a_value_error() -> None:
    """UpstreamSpecError is a ValueError, so generic validation catches it."""
    assert issubclass(UpstreamSpecError, ValueError)


def test_table_rejects_duplicate_model_names() -> None:
    """The same model name twice is UpstreamSpecError, even with different upstreams."""
    routes = [route("m=http://a:1"), route("m=http://b:2")]
    with pytest.raises(UpstreamSpecError, match="given twice"):
        RoutingTable(routes)


def test_table_get_len_iter() -> None:
    """get finds a route by exact name, len counts routes, iteration yields them in order."""
    a = route("a=http://h:1")
    b = route("org/b=http://h:2")
    table = RoutingTable(iter([a, b]))
    assert table.get("a") is a
    assert table.get("org/b") is b
    assert table.get("A") is None
    assert table.get("b") is None
    assert len(table) == 2
    assert list(table) == [a, b]


def test_empty_table() -> None:
    """An empty table has no routes and no upstreams."""
    table = RoutingTable([])
    assert len(table) == 0
    assert list(table) == []
    assert table.upstreams() == []


def test_upstreams_are_deduplicated_in_first_named_order() -> None:
    """Several names on one upstream give that upstream once, in the order first named."""
    table = RoutingTable(
        [
            route("x=http://b:2/v1"),
            route("y=http://a:1"),
            route("z=http://b:2/"),
            route("w=http://a:1/api/v1"),
        ]
    )
    assert table.upstreams() == [
        UpstreamAddress("b", 2),
        UpstreamAddress("a", 1),
        UpstreamAddress("a", 1, "/api"),
    ]


def test_address_is_frozen_and_hashable() -> None:
    """UpstreamAddress is an immutable value usable as a dict key."""
    address = UpstreamAddress("h", 1)
    assert {address: 1}[UpstreamAddress("h", 1)] == 1
    with pytest.raises(AttributeError):
        address.port = 2  # type: ignore[misc]
