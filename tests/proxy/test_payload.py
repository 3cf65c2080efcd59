"""proxy.payload.extract_model: the one look inside the request body."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from engines.spec import Guards
from proxy.errors import HTTPError
from proxy.payload import RequestGuards, check_request, extract_model

# A route with no engine named: the spec's defaults.
NO_ENGINE = Guards()


def model_of(body: bytes, endpoint: bytes = b"", guards: RequestGuards = NO_ENGINE) -> str:
    """extract_model, for a route with no engine named unless guards are given."""
    return extract_model(body, endpoint, guards)


def body_of(**fields: Any) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})


def rejection(body: bytes) -> HTTPError:
    """The HTTPError extract_model raises for body, checked to be a 400."""
    with pytest.raises(HTTPError) as info:
        model_of(body)
    assert info.value.status == 400
    return info.value


def test_valid_body_returns_model() -> None:
    """A JSON object with a string model returns that model unchanged."""
    assert model_of(body_of(model="org/Qwen2.5-0.5B-Instruct")) == "org/Qwen2.5-0.5B-Instruct"


def test_model_is_returned_byte_for_byte_with_unicode_and_spaces() -> None:
    """The model name is not trimmed or normalised."""
    assert model_of(body_of(model=" modèle ")) == " modèle "


def test_empty_body_is_400_invalid_json() -> None:
    """An empty body is a 400 invalid_json with no param."""
    err = rejection(b"")
    assert err.code == "invalid_json"
    assert err.param is None


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"model": "m",}', b"\xff\xfe", b'{"model": "m"} x'])
def test_invalid_json_is_400_invalid_json(body: bytes) -> None:
    """A body that is not JSON (or not UTF-8) is a 400 invalid_json."""
    err = rejection(body)
    assert err.code == "invalid_json"
    assert err.param is None
    assert err.message.startswith("request body is not valid JSON")


@pytest.mark.parametrize("body", [b"[]", b'[{"model": "m"}]', b'"m"', b"42", b"null", b"true"])
def test_json_that_is_not_an_object_is_400_invalid_json(body: bytes) -> None:
    """A JSON array, string, number, null or boolean is a 400 invalid_json."""
    err = rejection(body)
    assert err.code == "invalid_json"
    assert err.message == "request body must be a JSON object"


def test_missing_model_is_400_missing_model() -> None:
    """A body without model is a 400 with param "model" and code missing_model."""
    err = rejection(body_of())
    assert (err.param, err.code) == ("model", "missing_model")


def test_null_model_is_400_missing_model() -> None:
    """ "model": null counts as missing."""
    err = rejection(body_of(model=None))
    assert (err.param, err.code) == ("model", "missing_model")


@pytest.mark.parametrize("model", [1, 0, "", ["m"], {"name": "m"}, True, 1.5])
def test_non_string_or_empty_model_is_400_invalid_model(model: Any) -> None:
    """A model that is not a non-empty string is a 400 with param "model" and code invalid_model."""
    err = rejection(body_of(model=model))
    assert (err.param, err.code) == ("model", "invalid_model")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, False, 1.5, 1.0, "5", [5], {"n": 5}])
def test_token_limit_below_one_or_not_an_integer_is_400(field: str, value: Any) -> None:
    """A token limit below 1 or not an integer (bool, float, string) is a 400 naming the field.

    mlx_lm.server's generation thread dies for good on max_tokens 0 and drops the socket on -1.
    """
    err = rejection(body_of(model="m", **{field: value}))
    assert (err.param, err.code) == (field, "invalid_value")
    assert err.message == f"{field} must be an integer of at least 1"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [None, 1, 4096, 2**40])
def test_token_limit_null_or_positive_integer_is_accepted(field: str, value: Any) -> None:
    """A token limit that is null or an integer of at least 1 passes."""
    assert model_of(body_of(model="m", **{field: value})) == "m"


def test_absent_token_limits_are_accepted() -> None:
    """A body without max_tokens or max_completion_tokens passes."""
    assert model_of(b'{"model":"m"}') == "m"


def test_model_is_checked_before_token_limits() -> None:
    """With both a bad model and a bad max_tokens, the error names the model."""
    err = rejection(body_of(model=5, max_tokens=0))
    assert err.param == "model"


def test_error_body_of_a_rejection_is_openai_shaped() -> None:
    """The rejection's body is OpenAI's envelope with the param and code set."""
    err = rejection(body_of(model="m", max_completion_tokens=0))
    assert orjson.loads(err.body()) == {
        "error": {
            "message": "max_completion_tokens must be an integer of at least 1",
            "type": "invalid_request_error",
            "param": "max_completion_tokens",
            "code": "invalid_value",
        }
    }


TYPED = Guards(check_types=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", -0.1),
        ("temperature", True),
        ("top_p", 1.5),
        ("top_k", 2.5),
        ("n", 0),
        ("seed", "1"),
        ("presence_penalty", "x"),
        ("stream", "yes"),
        ("logprobs", 1),
        ("stop", ["a", 2]),
        ("stop", 5),
    ],
)
def test_checked_fields_of_the_wrong_type_or_range_are_400s_naming_them(field: str, value: Any) -> None:
    """With check_types, a sampling field of the wrong type or range is a 400 naming the field."""
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", **{field: value}), b"/chat/completions", TYPED)
    assert info.value.status == 400 and info.value.param == field and info.value.code == "invalid_type"


def test_well_typed_fields_pass_the_type_check() -> None:
    """Ordinary values of every checked field pass, and absent or null fields are not looked at."""
    body = body_of(
        model="m",
        temperature=0,
        top_p=0.9,
        top_k=40,
        n=1,
        seed=7,
        presence_penalty=-0.5,
        stream=True,
        logprobs=False,
        stop=["\n"],
        frequency_penalty=None,
    )
    assert model_of(body, b"/chat/completions", TYPED) == "m"


def test_a_message_without_a_string_role_is_a_400() -> None:
    """A chat message that is not an object with a string role is named by its index."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, "hi"]})
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/chat/completions", TYPED)
    assert info.value.param == "messages[1]"


def test_types_are_not_checked_without_the_guard() -> None:
    """Static upstreams get the client's fields as they are: the type check is an engine guard."""
    assert model_of(body_of(model="m", temperature="hot"), b"/chat/completions") == "m"


def test_legacy_completions_logprobs_is_a_count_unless_the_engine_takes_a_flag() -> None:
    """`logprobs: 2` on /completions passes (OpenAI's count), but not for an engine that takes a flag."""
    body = orjson.dumps({"model": "m", "prompt": "hi", "logprobs": 2})
    assert model_of(body, b"/completions", TYPED) == "m"
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/completions", Guards(check_types=True, completion_logprobs="flag"))
    assert info.value.param == "logprobs"


def test_null_sampling_fields_are_dropped_and_reported() -> None:
    """A field sent as null (OpenAI's default) is removed, and check_request says the body changed."""
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": None, "stop": None}
    assert check_request(doc, b"/chat/completions", TYPED) is True
    assert "temperature" not in doc and "stop" not in doc
    assert check_request({"model": "m", "messages": []}, b"/chat/completions", TYPED) is False


def test_engine_limits_on_seed_and_top_logprobs() -> None:
    """An engine's own limits (mlx: seed from 0, top_logprobs to 11) are 400s naming the field."""
    mlx = Guards(check_types=True, seed_min=0, top_logprobs_max=11)
    for field, value in (("seed", -5), ("top_logprobs", 15)):
        with pytest.raises(HTTPError) as info:
            model_of(body_of(model="m", **{field: value}), b"/chat/completions", mlx)
        assert info.value.param == field
    assert model_of(body_of(model="m", seed=-5, top_logprobs=15), b"/chat/completions", TYPED) == "m"
