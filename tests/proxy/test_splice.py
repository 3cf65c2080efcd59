"""proxy.splice: the members the gateway changes, and every other byte of the client's body kept."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from proxy.splice import splice

BIG = b"123456789012345678901234567890"


def spliced(body: bytes | bytearray, drop: tuple[str, ...] = (), **put: Any) -> bytes:
    """``splice`` with the parsed body's keys, as the relay calls it."""
    return splice(body, orjson.loads(body).keys(), drop, put)


def test_an_added_member_leaves_every_other_byte_as_it_was() -> None:
    """stream and stream_options added to a body without them: the client's bytes, then the members."""
    body = (
        b'{"model": "m",  "messages": [{"role":"user","content":"\\u00e9"}], "n": ' + BIG + b', "x": 1.50}\n'
    )
    out = spliced(body, stream=True, stream_options={"include_usage": True})
    assert out == body[:-2] + b',"stream":true,"stream_options":{"include_usage":true}}\n'


def test_numbers_past_a_double_s_precision_are_kept_exactly_on_a_rename() -> None:
    """A 30-digit integer and a long fraction cross a model rename as the client wrote them."""
    body = (
        b'{"messages":[],"model":"alias","seed":'
        + BIG
        + b',"temperature":0.1000000000000000055511151231257827}'
    )
    out = spliced(body, model="served")
    assert out == body.replace(b'"alias"', b'"served"')
    assert orjson.loads(out)["model"] == "served"


def test_a_replaced_member_keeps_its_place_and_a_dropped_one_its_neighbours_spacing() -> None:
    """A present member takes the new value in place; a dropped one goes with its comma."""
    body = b'{ "stream" : false ,\n "model":"m", "temperature": null, "top_p": 1 }'
    out = spliced(body, ("temperature",), stream=True, stream_options={"include_usage": True})
    assert out == b'{ "stream" : true ,\n "model":"m", "top_p": 1,"stream_options":{"include_usage":true} }'


def test_dropping_the_first_or_every_member_leaves_valid_json() -> None:
    """Dropping the first member, or all of them, leaves a valid object with the rest intact."""
    body = b'{"temperature":null,"model":"m","stop":null}'
    assert spliced(body, ("temperature",)) == b'{"model":"m","stop":null}'
    assert orjson.loads(spliced(body, ("temperature", "model", "stop"))) == {}


def test_keys_are_compared_decoded_and_a_repeated_key_is_set_once_where_parsers_read_it() -> None:
    """ "mod\\u0065l" is model; of a key given twice the last is the one replaced, the earlier dropped."""
    body = b'{"model":"a","x":[1,{"model":"inner"}],"mod\\u0065l":"b"}'
    out = spliced(body, model="c")
    assert out == b'{"x":[1,{"model":"inner"}],"mod\\u0065l":"c"}'
    assert orjson.loads(out) == {"x": [1, {"model": "inner"}], "model": "c"}


@pytest.mark.parametrize(
    "value",
    [b'"a,b}\\"c"', b'[1, [2, {"}": "]"}]]', b"-0.0e-5", b"true", b"null", b'{"a":{"b":{}}}'],
)
def test_values_of_every_kind_are_skipped_whole(value: bytes) -> None:
    """Strings with braces and escaped quotes, nested arrays, numbers and literals are walked over intact."""
    body = b'{"a": ' + value + b', "model": "m", "b": ' + value + b"}"
    assert spliced(body, model="n") == body.replace(b'"model": "m"', b'"model": "n"')


@pytest.mark.parametrize(
    ("body", "drop", "put", "expected"),
    [
        (
            b' \r\n{ \t"model" \n: \t"a" \r, "stream"\t:\nfalse\n }\n ',
            (),
            {"model": "b", "stream": True},
            b' \r\n{ \t"model" \n: \t"b" \r, "stream"\t:\ntrue\n }\n ',
        ),
        (
            b'{"stream":false,"model":"m","stream":false}',
            (),
            {"stream": True},
            b'{"model":"m","stream":true}',
        ),
        (b'{"m\\u006fdel":"a","x":1}', (), {"model": "b"}, b'{"m\\u006fdel":"b","x":1}'),
        (
            '{"modèle":"é😀","model":"a","😀":["ü"]}'.encode(),
            (),
            {"model": "ñ"},
            '{"modèle":"é😀","model":"ñ","😀":["ü"]}'.encode(),
        ),
        (
            b'{"temperature":null,"model":"a","seed":' + BIG + b"}",
            ("temperature",),
            {"model": "b"},
            b'{"model":"b","seed":' + BIG + b"}",
        ),
        (
            '{"model":"a","messages":[{"role":"user","content":"x😀\\"}"}],"stream":false}'.encode(),
            (),
            {"stream": True, "stream_options": {"include_usage": True}},
            '{"model":"a","messages":[{"role":"user","content":"x😀\\"}"}],"stream":true,'
            '"stream_options":{"include_usage":true}}'.encode(),
        ),
    ],
    ids=["whitespace", "duplicate", "escaped-key", "utf8", "null-and-rename", "emoji"],
)
def test_tricky_bodies_keep_every_byte_the_gateway_does_not_change(
    body: bytes, drop: tuple[str, ...], put: dict[str, Any], expected: bytes
) -> None:
    """White space everywhere, a repeated key, escaped and UTF-8 keys, big integers and emoji: only the
    named members change."""
    assert spliced(body, drop, **put) == expected
    assert spliced(bytearray(body), drop, **put) == expected


@pytest.mark.parametrize("depth", [20, 100])
def test_values_nested_deeper_than_one_match_takes_are_walked_whole(depth: int) -> None:
    """Arrays and objects nested past what one match skips, with long and escaped strings, stay intact."""
    long = b'"' + b"y" * 300 + b'\\"]}"'
    inner = b"[" * depth + long + b', {"a": [1, "b"]}' + b"]" * depth
    body = b'{"v": ' + inner + b', "model" : "m", "w": {"k": ' + inner + b"}}"
    assert spliced(body, model="n") == body.replace(b'"model" : "m"', b'"model" : "n"')


def test_splice_holds_about_one_more_body_whatever_its_characters() -> None:
    """A 5 MB chat with one emoji and "stream": false is spliced holding under 3x the body at peak.

    Decoding it to a str (4 bytes a character with an emoji) and building
    each value again held 20x.
    """
    body = orjson.dumps(
        {"model": "m", "stream": False, "messages": [{"role": "user", "content": "x" * 5_000_000 + "😀"}]}
    )
    present = orjson.loads(body).keys()
    tracemalloc.start()
    try:
        out = splice(body, present, (), {"stream": True, "stream_options": {"include_usage": True}})
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (
        out
        == body.replace(b'"stream":false', b'"stream":true')[:-1]
        + b',"stream_options":{"include_usage":true}}'
    )
    assert peak_bytes < 3 * len(body)
