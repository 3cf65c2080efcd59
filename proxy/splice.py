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

The walk reads the bytes as they are, with regular expressions: nothing is
decoded but the keys, no value is built, and the result is joined from views
of the client's bytes and the new values, so a splice holds the body about
once more, whatever its characters (decoding it made a str of up to four
bytes a character, and each value was built again as Python objects).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from proxy.payload import MAX_DEPTH

_SPACE = re.compile(rb"[ \t\n\r]*+")
# A string's bytes but its quote and escapes (JSON takes no control character in a string). Ranges,
# for speed: the regular expression engine tests ranges three times faster than a negated set.
_PLAIN = rb"[ !#-\[\]-\xff]"
_STRING = re.compile(rb'"' + _PLAIN + rb"*+(?:\\." + _PLAIN + rb"*+)*+\"", re.DOTALL)
_ESCAPED = re.compile(rb"(?:\\." + _PLAIN + rb"*+)*+\"", re.DOTALL)
_SCALAR = re.compile(rb"[-+.0-9A-Za-z]++")
# Bytes between brackets: white space, separators, numbers, literals and strings whose runs
# between escapes are short (a longer run is found by ``bytes.find``, faster past about a hundred
# bytes). Escapes are taken here too: a body of many short escaped strings was one Python step
# per string, 0.3-0.6 s for 2 MB on the event loop.
_FLAT = rb'[^"\[\]{}]++|"' + _PLAIN + rb"{0,128}+(?:\\." + _PLAIN + rb'{0,128}+)*+"'
_OPENERS = b"[{"


def _nested(levels: int) -> re.Pattern[bytes]:
    """Up to the next bracket or string that is not part of an array or object nested at most
    ``levels`` deep, made only of what ``_FLAT`` matches (those are skipped by one match)."""
    inside = rb"(?:" + _FLAT + rb")*+"
    for _ in range(levels):
        inside = rb"(?:" + _FLAT + rb"|[\[{]" + inside + rb"[\]}])*+"
    return re.compile(inside)


# As deep as a body may nest (payload.MAX_DEPTH, checked before any splice): one match skips a
# whole value, where a shallower pattern left a Python step per level past it (compiled once).
_SHALLOW = _nested(MAX_DEPTH + 1)


def _skip(body: bytes | bytearray, at: int) -> int:
    """Past JSON's white space from ``at``."""
    match = _SPACE.match(body, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _string_end(body: bytes | bytearray, at: int) -> int:
    """The end of the string whose opening quote is at ``at``."""
    end = body.find(b'"', at + 1)
    escape = body.find(b"\\", at + 1, end)
    if escape < 0:
        return end + 1
    match = _ESCAPED.match(body, escape)  # the quote found may be escaped
    assert match is not None  # orjson parsed the body: the string ends
    return match.end()


def _value_end(body: bytes | bytearray, at: int) -> int:
    """The end of the value that starts at ``at``."""
    first = body[at]
    if first == 0x22:  # '"'
        return _string_end(body, at)
    if first not in _OPENERS:
        scalar = _SCALAR.match(body, at)
        assert scalar is not None  # orjson parsed the body: a number or a literal
        return scalar.end()
    depth = 0
    while True:  # at a bracket or a string that _SHALLOW stopped at (first, the opening bracket)
        token = body[at]
        if token == 0x22:
            at = _string_end(body, at)
        else:
            depth += 1 if token in _OPENERS else -1
            at += 1
            if not depth:
                return at
        shallow = _SHALLOW.match(body, at)
        assert shallow is not None  # the pattern matches the empty string
        at = shallow.end()


def _members(body: bytes | bytearray) -> list[tuple[int, str, int, int]]:
    """Each top-level member of the object ``body``: (its start, its key, its value's start and end)."""
    at = _skip(body, _skip(body, 0) + 1)  # past "{"
    found: list[tuple[int, str, int, int]] = []
    while body[at] != 0x7D:  # "}"
        start = at
        key_end = _string_end(body, at)
        at = _skip(body, _skip(body, key_end) + 1)  # past ":"
        value_end = _value_end(body, at)
        found.append((start, orjson.loads(body[start:key_end]), at, value_end))
        at = _skip(body, value_end)
        if body[at] == 0x2C:  # ","
            at = _skip(body, at + 1)
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
    new = {key: orjson.dumps(value) for key, value in put.items()}
    with memoryview(body) as view:
        if touched.isdisjoint(present):
            end = body.rfind(b"}")
            added = b"".join(b"," + orjson.dumps(key) + b":" + value for key, value in new.items())
            return b"".join((view[:end], added[1:] if not present else added, view[end:]))
        members = _members(body)
        last = {key: index for index, (_, key, _, _) in enumerate(members)}
        pieces: list[bytes | memoryview] = [view[: members[0][0]]]
        kept = -1  # the last member kept
        for index, (start, key, value_start, value_end) in enumerate(members):
            if key in touched and (key not in new or last[key] != index):
                continue
            if kept >= 0:
                # The separator that followed the last member kept: a member left out goes with its own.
                pieces.append(view[members[kept][3] : members[kept + 1][0]])
            if key in touched:
                pieces += (view[start:value_start], new[key])
            else:
                pieces.append(view[start:value_end])
            kept = index
        comma = b"," if kept >= 0 else b""
        for key, value in new.items():
            if key not in last:
                pieces += (comma, orjson.dumps(key), b":", value)
                comma = b","
        pieces.append(view[members[-1][3] :])
        spliced = b"".join(pieces)
        del pieces  # the views, before the view they were taken from is released
    return spliced
