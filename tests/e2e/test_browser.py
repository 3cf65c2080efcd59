"""A web page cannot use a gateway on its visitor's machine: DNS rebinding and cross-origin requests."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

pytestmark = pytest.mark.fault("clients", "a web page: DNS rebinding and cross-origin requests")

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
EVIL = "https://evil.example.net"


def code_of(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    code: str = error["code"]
    return code


def request(http: httpx.Client, gateway: Running, method: str, path: str, **headers: str) -> httpx.Response:
    """One request with these headers (a ``host`` given replaces the URL's)."""
    content = BODY if method == "POST" else None
    return http.request(method, gateway.url + path, content=content, headers=headers)


ROUTES = [
    ("POST", CHAT),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/fake"),
    ("GET", "/metrics"),
    ("POST", "/admin/models/fake/load"),
    ("GET", "/livez"),
    ("GET", "/readyz"),
    ("GET", "/health"),
    ("GET", "/version"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_dns_rebinding_host_is_refused_on_every_route(
    gateway: Running, fake: FakeEngine, http: httpx.Client, method: str, path: str
) -> None:
    """A page whose name was rebound to the gateway (Host and Origin its own) gets 403 on every route."""
    rebound = f"rebind.attacker.example:{gateway.port}"
    response = request(
        http,
        gateway,
        method,
        path,
        host=rebound,
        origin=f"http://{rebound}",
        **({"content-type": "application/json"} if method == "POST" else {}),
    )
    assert response.status_code == 403, response.text
    assert code_of(response) == "host_not_allowed"
    assert "--allowed-hosts" in response.json()["error"]["message"]
    assert fake.records() == []


@pytest.mark.parametrize(
    "host",
    [
        "REBIND.ATTACKER.EXAMPLE",  # upper case
        "rebind.attacker.example.",  # the FQDN form
        "rebind.attacker.example:1",  # another port
        "localhost.attacker.example",  # a local name as a prefix
        "127.0.0.1.nip.io",  # an address as a prefix
        "[::1",  # malformed
        "localhost:8000:1",  # malformed
    ],
)
def test_dns_rebinding_variants_are_refused(
    gateway: Running, fake: FakeEngine, http: httpx.Client, host: str
) -> None:
    """A foreign name is refused in any case, with a trailing dot or any port, and a malformed Host too."""
    response = request(http, gateway, "POST", CHAT, host=host, **{"content-type": "application/json"})
    assert response.status_code == 403
    assert code_of(response) == "host_not_allowed"
    assert fake.records() == []


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST:{port}",
        "localhost.:{port}",
        "app.localhost:{port}",
        "127.0.0.1:{port}",
        "127.0.0.2",
        "[::1]:{port}",
        # A port mapping (docker -p 9000:8000) or a proxy in front: ports are not compared.
        "localhost:9000",
        # Kubernetes' probes and load balancers' checks name the pod's or server's address.
        "10.1.2.3:{port}",
        "[fd00::1]",
    ],
)
def test_local_names_and_addresses_are_served(
    gateway: Running, fake: FakeEngine, http: httpx.Client, host: str
) -> None:
    """Loopback names, *.localhost and any IP address are the gateway's own, with any port or none."""
    host = host.format(port=gateway.port)
    response = request(http, gateway, "POST", CHAT, host=host, **{"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert request(http, gateway, "GET", "/readyz", host=host).status_code == 200


def test_allowed_hosts_adds_names_and_star_allows_any(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """--allowed-hosts serves the names it lists (any case, any port) and no other; * serves any."""
    listed = start_gateway({"fake": fake.url}, "--allowed-hosts", "llm.example.com, blazar.ns.svc.")
    for host in ("llm.example.com", "LLM.example.com:443", "blazar.ns.svc:8000", "blazar.ns.svc."):
        assert request(http, listed, "GET", "/v1/models", host=host).status_code == 200, host
    refused = request(http, listed, "GET", "/v1/models", host="other.example.com")
    assert refused.status_code == 403
    assert code_of(refused) == "host_not_allowed"
    anyone = start_gateway({"fake": fake.url}, "--allowed-hosts", "*")
    assert request(http, anyone, "GET", "/v1/models", host="blazar").status_code == 200


def test_allowed_hosts_from_the_config_file_as_a_list_or_a_string(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, tmp_path: Path
) -> None:
    """The file's [gateway] allowed-hosts takes a TOML list or a comma-separated string."""
    for value in ('["llm.example.com", "blazar"]', '"llm.example.com,blazar"'):
        path = tmp_path / "gateway.toml"
        path.write_text(f'[gateway]\nallowed-hosts = {value}\n[models.fake]\nupstream = "{fake.url}"\n')
        gateway = start_gateway({}, "--config", str(path))
        for host in ("llm.example.com", "blazar:8000"):
            assert request(http, gateway, "GET", "/v1/models", host=host).status_code == 200, (value, host)
        assert request(http, gateway, "GET", "/v1/models", host="other.example").status_code == 403
        gateway.stop()


def test_a_bad_allowed_host_is_an_error_at_start(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """A URL where a name belongs stops the gateway at start with one line saying which setting."""
    with pytest.raises(RuntimeError, match=r"--allowed-hosts: 'https://llm.example.com' is not a host name"):
        start_gateway({"fake": fake.url}, "--allowed-hosts", "https://llm.example.com")


@pytest.mark.parametrize("content_type", [None, "application/json", "text/plain;charset=UTF-8"])
def test_a_cross_origin_post_is_refused_whatever_its_content_type(
    gateway: Running, fake: FakeEngine, http: httpx.Client, content_type: str | None
) -> None:
    """With CORS off, a page's POST (a no-cors fetch of a blob has no Content-Type) generates nothing."""
    headers = {"origin": EVIL, **({"content-type": content_type} if content_type else {})}
    response = http.post(gateway.url + CHAT, content=BODY, headers=headers)
    assert response.status_code == 403
    assert code_of(response) == "origin_not_allowed"
    assert response.headers["vary"] == "Origin"
    assert "access-control-allow-origin" not in response.headers
    assert fake.records() == []


def test_an_origin_cors_does_not_allow_is_refused_on_every_route(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """With CORS on for one origin, another origin (and `null`, a sandboxed page's) gets 403 everywhere."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", "https://app.example.com")
    for method, path in ROUTES:
        for origin in (EVIL, "null", "https://app.example.com.evil.example.net", "http://app.example.com"):
            response = request(http, gateway, method, path, origin=origin)
            assert response.status_code == 403, (path, origin, response.text)
            assert code_of(response) == "origin_not_allowed"
        assert fake.records() == []
        allowed = request(http, gateway, method, path, origin="https://app.example.com")
        assert allowed.status_code != 403, (path, allowed.text)
        fake.reset()


def test_allowed_and_any_origins_are_served(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """An origin CORS allows is served without a Content-Type; with * every origin is, `null` included."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", "https://app.example.com")
    response = http.post(gateway.url + CHAT, content=BODY, headers={"origin": "https://app.example.com"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    anyone = start_gateway({"fake": fake.url}, "--cors-origin", "*")
    for origin in (EVIL, "null"):
        response = http.post(anyone.url + CHAT, content=BODY, headers={"origin": origin})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"


def test_a_same_origin_page_is_served(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """A page the gateway itself would serve (Origin is its own scheme, host and port) may use it."""
    for origin in (f"http://127.0.0.1:{gateway.port}", f"http://LOCALHOST:{gateway.port}"):
        host = origin.removeprefix("http://").lower()
        response = request(http, gateway, "POST", CHAT, host=host, origin=origin)
        assert response.status_code == 200, response.text
    # Another port of the same machine is another origin.
    other = request(http, gateway, "POST", CHAT, origin=f"http://127.0.0.1:{gateway.port + 1}")
    assert other.status_code == 403


def test_rebinding_is_not_same_origin_when_any_host_is_allowed(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """With --allowed-hosts *, a rebound page's Host equals its Origin, and its POST is still refused."""
    gateway = start_gateway({"fake": fake.url}, "--allowed-hosts", "*")
    rebound = f"rebind.attacker.example:{gateway.port}"
    response = request(http, gateway, "POST", CHAT, host=rebound, origin=f"http://{rebound}")
    assert response.status_code == 403
    assert code_of(response) == "origin_not_allowed"
    assert fake.records() == []


def test_a_cross_site_request_without_origin_is_refused(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """A no-cors GET (an <img src>: no Origin, Sec-Fetch-Site: cross-site) gets 403; a typed URL does not."""
    refused = request(http, gateway, "GET", "/metrics", **{"sec-fetch-site": "cross-site"})
    assert refused.status_code == 403
    assert code_of(refused) == "origin_not_allowed"
    for site in ("none", "same-origin", "same-site"):
        assert request(http, gateway, "GET", "/metrics", **{"sec-fetch-site": site}).status_code == 200


def test_a_request_with_two_origins_is_refused(gateway: Running, fake: FakeEngine) -> None:
    """A foreign Origin followed by the gateway's own is refused: no browser sends two."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:%d\r\n"
        b"Origin: https://evil.example.net\r\nOrigin: http://localhost:%d\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % (gateway.port, gateway.port, len(BODY))
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head + BODY)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"origin_not_allowed" in answer
    assert fake.records() == []


def _raw(gateway: Running, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_an_absolute_form_target_names_the_host_and_its_authority_is_checked(
    gateway: Running, fake: FakeEngine
) -> None:
    """``POST http://evil.example/v1/chat/completions`` with ``Host: localhost`` is refused: the target's
    authority is the request's host (RFC 9112 §3.2.2), not the Host field; a local one is served."""
    head = (
        b"POST %s HTTP/1.1\r\nHost: localhost:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n"
    )
    foreign = _raw(
        gateway, head % (b"http://rebind.evil.example/v1/chat/completions", gateway.port, len(BODY)) + BODY
    )
    assert foreign.startswith(b"HTTP/1.1 403"), foreign[:200]
    assert b"host_not_allowed" in foreign and b"rebind.evil.example" in foreign
    assert fake.records() == []
    local = b"http://localhost:%d/v1/chat/completions" % gateway.port
    served = _raw(gateway, head % (local, gateway.port, len(BODY)) + BODY)
    assert served.startswith(b"HTTP/1.1 200"), served[:200]
    ipv6 = _raw(
        gateway,
        b"GET http://[::1]:%d/v1/models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
        % gateway.port,
    )
    assert ipv6.startswith(b"HTTP/1.1 200"), ipv6[:200]
