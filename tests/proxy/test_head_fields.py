"""The fast path's one walk of a request's fields decides as the task path's walks do."""

from __future__ import annotations

import random
import re

import pytest

from proxy.auth import CREDENTIAL_HEADERS
from proxy.browser import AllowedHosts, BrowserChecks
from proxy.cors import Cors
from proxy.errors import HTTPError
from proxy.headers import POST_HEAD, forward_request_headers, request_drop, request_head
from proxy.relay.head import HeadFields
from proxy.relay.ids import RequestIds
from proxy.relay.request import BodyBudget, RequestBody, check_head, refuses_head

_LIMIT = 1000
_VALUES = {
    b"host": [b"localhost:8000", b"127.0.0.1", b"evil.example", b"", b"LOCALHOST", b"gw.lan:1"],
    b"origin": [b"http://localhost:8000", b"https://app.example", b"null", b"http://evil.example"],
    b"sec-fetch-site": [b"cross-site", b"same-origin", b"none", b"same-site"],
    b"content-type": [
        b"application/json",
        b"Application/JSON; charset=utf-8",
        b"application/x-www-form-urlencoded",
        b"text/plain",
        b"application/vnd.api+json",
        b"",
        b" application/json ;x=1",
    ],
    b"content-length": [b"0", b"12", b"999", b"1000", b"1001", b"50000", b"x1", b"-1", b""],
    b"x-request-id": [b"abc-1", b"", b"has space", b"\xff\xfe", b"x" * 201, b"ok.2"],
    b"connection": [b"keep-alive", b"close", b"Keep-Alive", b"x-secret", b"close, x-other", b"upgrade"],
    b"user-agent": [b"bench", b"openai-python/1.0"],
    b"authorization": [b"Bearer k"],
    b"cookie": [b"a=b"],
    b"accept-encoding": [b"gzip"],
    b"x-forwarded-for": [b"10.0.0.1"],
    b"x-secret": [b"s"],
    b"x-other": [b"o"],
    b"close": [b"c"],
    b"keep-alive": [b"timeout=5"],
    b"x-stainless-os": [b"Linux"],
}


def _heads(seed: int, count: int) -> list[list[tuple[bytes, bytes]]]:
    rng = random.Random(seed)
    names = list(_VALUES)
    heads = []
    for _ in range(count):
        head = []
        for _ in range(rng.randint(0, 9)):
            name = rng.choice(names)
            head.append((name, rng.choice(_VALUES[name])))
        heads.append(head)
    return heads


@pytest.mark.parametrize("strip", [False, True])
def test_one_walk_decides_as_the_task_paths_walks(strip: bool) -> None:
    drop = request_drop(CREDENTIAL_HEADERS if strip else frozenset())
    checks = BrowserChecks(AllowedHosts(["gw.lan"], port=8000), Cors(["https://app.example"]))
    budget = BodyBudget(900)
    ids = RequestIds()
    walked = refused = forwarded = 0
    for headers in _heads(7 + strip, 4000):
        scope = {"method": "POST", "path": "/v1/chat/completions", "headers": headers}
        fields = HeadFields(headers, drop)

        if fields.hosts <= 1:
            walked += 1
            expected = checks.refusal(scope)
            got = checks.refusal_of(fields.host, fields.origin, fields.origins > 1, fields.site)
            assert (got is None) == (expected is None), headers
            if got is not None and expected is not None:
                assert (got.status, got.code, got.message) == (
                    expected.status,
                    expected.code,
                    expected.message,
                )

        try:
            check_head(scope, _LIMIT, RequestBody(budget))
        except HTTPError:
            head_refused = True
        else:
            head_refused = False
        assert refuses_head(fields, _LIMIT, budget) == head_refused, headers
        refused += head_refused

        if fields.request_id is not None:
            assert ids.of(fields.request_id) == ids(scope)
        else:
            assert ids(scope) not in {value for name, value in headers if name == b"x-request-id"}

        if fields.forward is not None:
            forwarded += 1
            lines = [
                *forward_request_headers(headers, drop),
                (b"x-request-id", b"r1"),
                (b"x-forwarded-for", b"p"),
            ]
            expected_head = request_head(b"POST", b"/v1/chat/completions", b"up:1", lines, 5)
            got_head = POST_HEAD % (
                b"/v1/chat/completions",
                b"up:1",
                5,
                b"".join(fields.forward),
                b"r1",
                b"p",
            )
            assert got_head == expected_head, headers
        else:
            # The task path's rule: a Connection field naming others, or more than one.
            connections = [value.lower() for name, value in headers if name == b"connection"]
            assert len(connections) > 1 or connections[0] not in (b"keep-alive", b"close"), headers
    # Each rule met both ways, and most heads read by the one walk alone.
    assert walked > 3000 and 500 < refused < 3500 and forwarded > 2500


def test_the_walk_notes_the_checks_fields_among_those_dropped() -> None:
    # ``HeadFields`` reads these only among the fields that never cross: they must stay there.
    for name in (b"host", b"content-type", b"content-length", b"x-request-id", b"connection"):
        assert name in request_drop()
    for name in (b"origin", b"sec-fetch-site"):
        assert name not in request_drop(CREDENTIAL_HEADERS)


def test_new_request_ids_are_the_prefix_and_a_count_in_32_hex_digits() -> None:
    """A request without a usable id gets the process's prefix and the next count: 32 hex digits,
    each new one the last plus one (the count as ``%016x`` writes it)."""
    ids = RequestIds()
    first, second = ids.of(None), ids({"headers": [(b"x-request-id", b"bad id")]})
    assert re.fullmatch(rb"[0-9a-f]{32}", first) and first[:16] == second[:16]
    assert int(second[16:], 16) == int(first[16:], 16) + 1 and first[16:] == b"%016x" % 1
    assert ids.of(b"given") == b"given" and ids({"headers": [(b"x-request-id", b"ok-1")]}) == b"ok-1"
