"""Top-level members of a JSON body replaced, left out or added, every other byte kept.

The gateway changes a request body in three cases only: an alias (``model``
renamed), a non-stream request sent as a stream (``stream`` and
``stream_options`` set), and a field sent as null that the engine cannot
take (left out: null is OpenAI's "the default"). Parsing the body and
serialising it again would change what the gateway never meant to touch:
numbers beyond a double's precision (``123456789012345678901234567890``
became ``1.2345678901234568e+29``), the escapes and spacing of strings, and
nesting past the serialiser's own depth limit. Splicing the named members
leaves the rest of the client's bytes as they were.

Only bodies that ``orjson`` has parsed as an object come here, so the walk
over their top-level members need not handle invalid JSON. Keys are compared
decoded (``"mod\\u0065l"`` is ``model``); a key given twice is a key given once
at the place of its last occurrence (what orjson and the engines' parsers
keep), the earlier ones left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

_SPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, at: int) -> int:
    """Past JSON's white space from ``at``."""
    match = _SPACE.match(text, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


# The standard library's C scanners (typeshed does not declare them): a key, and the end of each
# top-level value (its object is thrown away).
_SCAN_KEY: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SCAN_VALUE: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _members(text: str) -> list[tuple[int, str, int, int]]:
    """Each top-level member of the object ``text``: (its start, its key, its value's start and end)."""
    at = _skip(text, _skip(text, 0) + 1)  # past "{"
    found: list[tuple[int, str, int, int]] = []
    while text[at] != "}":
        start = at
        key, at = _SCAN_KEY(text, at + 1)
        at = _skip(text, _skip(text, at) + 1)  # past ":"
        value_start = at
        _, at = _SCAN_VALUE(text, at)
        found.append((start, key, value_start, at))
        at = _skip(text, at)
        if text[at] == ",":
            at = _skip(text, at + 1)
    return found


def splice(
    body: bytes | bytearray, present: Collection[str], drop: Collection[str], put: Mapping[str, Any]
) -> bytes:
    """``body`` with the top-level members named in ``drop`` left out and those in ``put`` set.

    ``present`` is the parsed body's keys: a body that has none of the names
    only gets the members of ``put`` added before its closing brace, without
    a walk over its members. A member of ``put`` that is present keeps its
    place, with the new value.
    """
    touched = set(drop).union(put)
    added = b"".join(b"," + orjson.dumps(key) + b":" + orjson.dumps(value) for key, value in put.items())
    if touched.isdisjoint(present):
        end = body.rstrip().rfind(b"}")
        return b"".join((body[:end], added, body[end:]))
    text = body.decode()
    members = _members(text)
    last = {key: index for index, (_, key, _, _) in enumerate(members)}
    pieces: list[str] = []
    kept = -1  # the last member kept
    for index, (start, key, value_start, value_end) in enumerate(members):
        if key in put and last[key] == index:
            value = orjson.dumps(put[key]).decode()
        elif key in touched:
            continue
        else:
            value = text[value_start:value_end]
        if kept >= 0:
            # The separator that followed the last member kept: a member left out goes with its own.
            pieces.append(text[members[kept][3] : members[kept + 1][0]])
        pieces.append(text[start:value_start] + value)
        kept = index
    pieces.extend(
        ("," if pieces else "") + f"{orjson.dumps(key).decode()}:{orjson.dumps(value).decode()}"
        for key, value in put.items()
        if key not in last
    )
    return (text[: members[0][0]] + "".join(pieces) + text[members[-1][3] :]).encode()
