"""proxy.splice: the members the gateway changes, and every other byte of the client's body kept."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.splice import splice

BIG = b"123456789012345678901234567890"


def spliced(body: bytes, drop: tuple[str, ...] = (), **put: Any) -> bytes:
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
