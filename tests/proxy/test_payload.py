"""proxy.payload.extract_model: the one look inside the request body."""

from __future__ import annotations

import dataclasses
import random
import tomllib
from typing import Any

import orjson
import pytest

from engines.spec import Guards, load, parse
from proxy.errors import HTTPError
from proxy.payload import (
    MAX_DEPTH,
    FieldChecks,
    RequestGuards,
    _openers,
    check_request,
    extract_model,
    nesting_depth,
    parse_request,
)

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


# A spec whose server types its fields as llama_cpp.server 0.3.36 did (its retired
# spec's [fields] and [completion_fields]): /completions' logprobs is a count, chat's
# a flag, and logit_bias takes token strings. The shipped llamacpp-b11434 declares no
# fields, so these rules are written here.
_TYPED_FIELDS_SPEC = """
name = "typed-1.0"
kind = "llamacpp"
version = "1.0"
model_formats = ["gguf"]
packages = { cpu = ["typed==1.0"] }
server = { argv = ["{python}", "--model", "{model}", "--alias", "{served_name}", "--port", "{port}"] }
readiness = { path = "/v1/chat/completions" }
model_field = { mode = "alias" }
guards = { min_max_tokens = 1, require_input = true }

[fields]
stream = { type = "boolean" }
max_tokens = { type = "integer", null = true }
temperature = { type = "number", min = 0 }
top_p = { type = "number", min = 0, max = 1 }
top_k = { type = "integer", min = 0 }
presence_penalty = { type = "number", min = -2, max = 2, null = true }
frequency_penalty = { type = "number", min = -2, max = 2, null = true }
logprobs = { type = "boolean", null = true }
top_logprobs = { type = "integer", min = 0, null = true }
seed = { type = "integer", null = true }
stop = { type = "strings", null = true }
logit_bias = { type = "bias", null = true }

[completion_fields]
logprobs = { type = "integer", min = 0, null = true }
max_tokens = { type = "integer", min = 0, null = true }
echo = { type = "boolean" }
"""

# mlx's guards as shipped; a llama.cpp-like server's typed fields (above).
MLX = load("mlx-0.32.0").guards
LLAMACPP = parse(tomllib.loads(_TYPED_FIELDS_SPEC), source="a test's llama.cpp-like spec").guards


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", -0.1),
        ("temperature", True),
        ("top_p", 1.5),
        ("top_k", 2.5),
        ("top_k", -1),
        ("seed", "1"),
        ("seed", -5),
        ("presence_penalty", "x"),
        ("stream", "yes"),
        ("logprobs", 1),
        ("stop", ["a", 2]),
        ("stop", 5),
        ("top_logprobs", 12),
        ("xtc_probability", 0),
        ("xtc_threshold", 0),
        ("xtc_probability", 1.5),
        ("repetition_context_size", -1),
        ("num_draft_tokens", "x"),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"5": "1"}),
        ("chat_template_kwargs", 5),
        ("stream_options", "x"),
    ],
)
def test_mlx_fields_it_cannot_take_are_400s_naming_them(field: str, value: Any) -> None:
    """A field mlx_lm.server would close the socket on (its validate_model_parameters) is a 400 naming it."""
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", **{field: value}), b"/chat/completions", MLX)
    assert info.value.status == 400 and info.value.param == field and info.value.code == "invalid_type"


def test_the_float_only_fields_of_mlx_say_how_to_write_them() -> None:
    """xtc_probability 0 (an int to Python) is refused with a message that shows 0.0; 0.0 and 1e0 pass."""
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", xtc_probability=0), b"/chat/completions", MLX)
    assert "0.0, not 0" in info.value.message
    assert model_of(
        b'{"model":"m","messages":[{"role":"user"}],"xtc_probability":1e0}', b"/chat/completions", MLX
    )


def test_well_typed_fields_pass_the_type_check() -> None:
    """Ordinary values of every checked field pass, and absent or null fields are not refused."""
    body = body_of(
        model="m",
        temperature=0,
        top_p=0.9,
        top_k=40,
        seed=7,
        presence_penalty=-0.5,
        stream=True,
        logprobs=False,
        top_logprobs=-1,
        stop=["\n"],
        frequency_penalty=None,
        xtc_probability=0.0,
        logit_bias={"5": -100, "17": 1.5},
        draft_model=None,
        adapters=None,
    )
    assert model_of(body, b"/chat/completions", dataclasses.replace(MLX, vocab_size=259)) == "m"
    assert model_of(
        body_of(model="m", temperature=0, logit_bias={"hello": 1}), b"/chat/completions", LLAMACPP
    )


def test_a_message_without_a_string_role_is_a_400() -> None:
    """A chat message that is not an object with a string role is named by its index."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, "hi"]})
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/chat/completions", MLX)
    assert info.value.param == "messages[1]"


def test_types_are_not_checked_without_the_guard() -> None:
    """Static upstreams get the client's fields as they are: the type check is an engine guard."""
    assert model_of(body_of(model="m", temperature="hot", draft_model="/etc"), b"/chat/completions") == "m"


def test_legacy_completions_logprobs_is_a_count_unless_the_engine_takes_a_flag() -> None:
    """`logprobs: 2` on /completions passes for llama.cpp (OpenAI's count), not for mlx (a flag)."""
    body = orjson.dumps({"model": "m", "prompt": "hi", "logprobs": 2})
    assert model_of(body, b"/completions", LLAMACPP) == "m"
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/completions", MLX)
    assert info.value.param == "logprobs"
    with pytest.raises(HTTPError):
        model_of(
            orjson.dumps({"model": "m", "messages": [{"role": "user"}], "logprobs": 2}),
            b"/chat/completions",
            LLAMACPP,
        )


def test_null_fields_the_engine_cannot_take_are_named_to_be_left_out() -> None:
    """A null (OpenAI's default) in a field the engine refuses null for is named; others are kept."""
    doc = {
        "model": "m",
        "messages": [{"role": "user"}],
        "temperature": None,
        "stop": None,
        "max_tokens": None,
    }
    assert check_request(doc, b"/chat/completions", MLX) == ("temperature", "max_tokens")  # as sent
    assert doc["temperature"] is None  # the check does not change the document
    assert check_request({"model": "m", "messages": [{"role": "user"}]}, b"/chat/completions", MLX) == ()


@pytest.mark.parametrize("field", ["draft_model", "adapters"])
def test_fields_that_make_mlx_load_something_are_refused_unless_the_model_allows_them(field: str) -> None:
    """draft_model and adapters name what mlx_lm.server loads: a 400 naming the field, unless allowed."""
    body = body_of(model="m", **{field: "/etc"})
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/chat/completions", MLX)
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "field_not_allowed")
    assert "allow-fields" in info.value.message
    allowed = dataclasses.replace(MLX, allowed=frozenset({field}))
    assert model_of(body, b"/chat/completions", allowed) == "m"
    with pytest.raises(HTTPError) as typed:
        model_of(body_of(model="m", **{field: 5}), b"/chat/completions", allowed)
    assert typed.value.code == "invalid_type"


def nested(depth: int) -> bytes:
    """A chat body whose first message's content nests ``depth`` lists (the body itself is 3 levels more)."""
    return b'{"model":"m","messages":[{"role":"user","content":' + b"[" * depth + b"]" * depth + b"}]}"


@pytest.mark.parametrize("depth", [MAX_DEPTH - 3, 1])
def test_bodies_up_to_the_depth_limit_pass(depth: int) -> None:
    """A body nested up to MAX_DEPTH levels passes, whatever its brackets inside strings."""
    assert model_of(nested(depth)) == "m"
    assert nesting_depth(nested(depth)) <= MAX_DEPTH


@pytest.mark.parametrize("depth", [MAX_DEPTH - 2, 300, 1000, 1030])
def test_bodies_nested_past_the_depth_limit_are_a_400_whatever_the_parser_takes(depth: int) -> None:
    """Past MAX_DEPTH, below or above orjson's own 1024, the 400 is the same: nested_too_deep."""
    err = rejection(nested(depth))
    assert err.code == "nested_too_deep" and str(MAX_DEPTH) in err.message


def test_brackets_and_escaped_quotes_in_strings_do_not_count_as_depth() -> None:
    """Depth counts only the structure: brackets inside strings, behind escaped quotes, are text."""
    text = '\\"' + "[" * 500 + '"' + "{" * 300
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "x": [[["\\"]]]})
    assert nesting_depth(body) == 4
    assert model_of(body) == "m"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","messages":[{"role":"user"}],"draft_m\\u006fdel":"/etc"}',
        b'{"model":"m","messages":[{"role":"user"}],"adapters":null,"adapters":"/etc"}',
        b'{"model":"m","messages":[{"role":"user"}],"adapters":""}',
    ],
)
def test_a_loading_field_is_refused_however_it_is_spelled(body: bytes) -> None:
    """An escaped key, a repeated key whose last value names a path, or an empty path are all refused."""
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/chat/completions", MLX)
    assert info.value.code == "field_not_allowed"


def test_token_ids_are_non_negative_and_below_the_model_s_vocabulary_and_refused_where_it_is_unknown() -> (
    None
):
    """logit_bias ids: -1 or a 5000-digit id are refused; past vocab_size too; any id where it is unknown."""
    for bias in ({"-1": 1}, {"9" * 5000: 1}, {"1.5": 1}):
        with pytest.raises(HTTPError) as info:
            model_of(body_of(model="m", logit_bias=bias), b"/chat/completions", MLX)
        assert info.value.param == "logit_bias"
    # Without the model's vocabulary (a hub repo, a static upstream), no id is known to be safe.
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", logit_bias={"99999999": 1}), b"/chat/completions", MLX)
    assert "vocabulary size is unknown" in info.value.message
    assert model_of(body_of(model="m", logit_bias={}), b"/chat/completions", MLX) == "m"
    tiny = dataclasses.replace(MLX, vocab_size=259)
    assert model_of(body_of(model="m", logit_bias={"258": 1, "0": -1}), b"/chat/completions", tiny) == "m"
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", logit_bias={"259": 1}), b"/chat/completions", tiny)
    assert "0 to 258" in info.value.message


# The built-in tiny model's facts (its config.json): 259 token ids, a 32768-token context.
TINY = dataclasses.replace(MLX, vocab_size=259, context_length=32768)


def refused_by_tiny(endpoint: bytes = b"/chat/completions", /, **fields: Any) -> HTTPError:
    """The 400 the tiny mlx model's route answers for a body with fields, checked to name the one field."""
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", prompt="p", **fields), endpoint, TINY)
    assert info.value.status == 400
    assert info.value.param == next(iter(fields))
    return info.value


def taken_by_tiny(endpoint: bytes = b"/chat/completions", /, **fields: Any) -> None:
    """The tiny mlx model's route takes a body with fields."""
    assert model_of(body_of(model="m", prompt="p", **fields), endpoint, TINY) == "m"


@pytest.mark.parametrize("top_k", [259, 260, 2**31, 2**63, True])
def test_top_k_at_or_past_the_vocabulary_is_refused(top_k: Any) -> None:
    """mlx's apply_top_k kills the generation thread for top_k >= the logits' width: refused from 259."""
    assert "from 0 to 258" in refused_by_tiny(top_k=top_k).message


def test_top_k_below_the_vocabulary_is_taken_and_bounded_without_one() -> None:
    """top_k 0 and 258 pass; a model of unknown vocabulary still bounds it to 2**31 - 1."""
    taken_by_tiny(top_k=0)
    taken_by_tiny(top_k=258)
    assert model_of(body_of(model="m", top_k=10**6), b"/chat/completions", MLX) == "m"
    with pytest.raises(HTTPError, match="from 0 to 2147483647"):
        model_of(body_of(model="m", top_k=2**31), b"/chat/completions", MLX)


@pytest.mark.parametrize("threshold", [0.9, 0.5000001, 1.0])
def test_xtc_threshold_past_a_half_is_refused(threshold: float) -> None:
    """mlx's apply_xtc kills the thread past 0.5 (its handler allows 1): refused."""
    assert "from 0 to 0.5" in refused_by_tiny(xtc_threshold=threshold).message


def test_xtc_threshold_up_to_a_half_is_taken() -> None:
    """0.0, 1e-300 and 0.5 pass."""
    for threshold in (0.0, 1e-300, 0.5):
        taken_by_tiny(xtc_threshold=threshold)


@pytest.mark.parametrize(
    "key", ["+5", " 5", "5 ", "1_0", "05", "00", "-1", "-300", "\u0665", "5.0", "", "259", "2147483647"]
)
def test_logit_bias_ids_must_be_canonical_decimals_below_the_vocabulary(key: str) -> None:
    """Each id Python's int() takes that is not written 0, 1, 2, ... (or is past the vocabulary): refused."""
    refused_by_tiny(logit_bias={key: 1})


def test_logit_bias_values_must_be_json_numbers() -> None:
    """Biases "nan", "inf" (float() takes them), a bool or null are refused; 0, -100 and 1e308 are taken."""
    for value in ("nan", "inf", True, None):
        refused_by_tiny(logit_bias={"5": value})
    taken_by_tiny(logit_bias={"0": 0, "5": -100, "258": 1e308})


@pytest.mark.parametrize(
    "field", ["repetition_context_size", "presence_context_size", "frequency_context_size"]
)
def test_context_sizes_past_31_bits_are_refused(field: str) -> None:
    """mlx slices tokens[-size:], which raises past 2**31 - 1 in the batch step: refused; 2**31 - 1 taken."""
    refused_by_tiny(**{field: 2**31})
    refused_by_tiny(**{field: 2**64 - 1})
    taken_by_tiny(**{field: 2**31 - 1})


@pytest.mark.parametrize("prompt", ["", ["ab", "cd"], ["ab"], [["a", "b"]], [1, 2, 3], []])
def test_an_mlx_completion_prompt_is_a_non_empty_string(prompt: Any) -> None:
    """An empty prompt or a list (mlx has no token-id prompts; strings in a list kill the thread): refused."""
    with pytest.raises(HTTPError) as info:
        model_of(orjson.dumps({"model": "m", "prompt": prompt}), b"/completions", TINY)
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_an_mlx_completion_prompt_of_one_space_is_taken_and_chat_ignores_prompt() -> None:
    """ " " is a prompt; a chat request's stray prompt field is not the completion endpoint's to check."""
    assert model_of(orjson.dumps({"model": "m", "prompt": " "}), b"/completions", TINY) == "m"
    assert model_of(body_of(model="m", prompt=""), b"/chat/completions", TINY) == "m"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"return_tensors": "np"},
        {"truncation": True, "max_length": 0},
        {"chat_template": "{% if false %}x{% endif %}"},
        {"padding": "max_length", "max_length": 200000},
        {"tokenize": True},
        {"tokenizer_kwargs": {"a": 1}},
        {"conversations": "x"},
        {"enable_thinking": [False]},
        {"enable_thinking": {"a": 1}},
    ],
)
def test_chat_template_kwargs_that_reconfigure_apply_chat_template_are_refused(
    kwargs: dict[str, Any],
) -> None:
    """apply_chat_template's own parameters, or values that are lists or objects, are refused."""
    assert "none of the keys" in refused_by_tiny(chat_template_kwargs=kwargs).message


def test_chat_template_kwargs_of_scalars_for_the_template_are_taken() -> None:
    """What templates read (enable_thinking: false, a string, a number, null) passes."""
    taken_by_tiny(chat_template_kwargs={"enable_thinking": False, "name": "x", "n": 2, "none": None})
    taken_by_tiny(chat_template_kwargs={})


@pytest.mark.parametrize(
    "stop", [["a", "b", "c", "d", "e"], "x" * 1001, ["ok", "x" * 1001], [f"w{i}" for i in range(20000)]]
)
def test_stop_past_four_strings_or_a_thousand_characters_is_refused(stop: Any) -> None:
    """mlx builds a trie and automata per stop word (101 kept): over 4, or over 1000 characters, refused."""
    assert "at most 4 in a list, at most 1000 characters each" in refused_by_tiny(stop=stop).message


def test_stop_within_the_limits_is_taken() -> None:
    """A string, four strings of 1000 characters, an empty one and an empty list pass."""
    for stop in ("x" * 1000, ["x" * 1000] * 4, [""], "", []):
        taken_by_tiny(stop=stop)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limits_past_the_model_s_context_length_are_refused(field: str) -> None:
    """Past config.json's max_position_embeddings is refused; up to it, taken; where unknown, unbounded."""
    assert "from 0 to 32768" in refused_by_tiny(**{field: 32769}).message
    refused_by_tiny(**{field: 10**18})
    taken_by_tiny(**{field: 32768})
    assert model_of(body_of(model="m", **{field: 10**9}), b"/chat/completions", MLX) == "m"


def test_seed_is_a_64_bit_unsigned_integer() -> None:
    """mx.random.seed takes a uint64: 0 and 2**64 - 1 pass; -1 and 2**64 are refused."""
    taken_by_tiny(seed=0)
    taken_by_tiny(seed=2**64 - 1)
    refused_by_tiny(seed=-1)
    with pytest.raises(HTTPError) as info:
        model_of(b'{"model":"m","prompt":"p","seed":18446744073709551616}', b"/completions", TINY)
    assert info.value.param == "seed"


@pytest.mark.parametrize("options", [{}, {"include_usage": 1}, {"include_usage": None}, {"x": True}, []])
def test_stream_options_without_a_boolean_include_usage_are_refused(options: Any) -> None:
    """mlx reads stream_options["include_usage"] whenever the object is given: without a boolean, refused."""
    with pytest.raises(HTTPError) as info:
        model_of(body_of(model="m", stream=True, stream_options=options), b"/chat/completions", TINY)
    assert info.value.param == "stream_options"


def test_stream_options_with_include_usage_or_null_are_taken() -> None:
    """{"include_usage": true}, {"include_usage": false, "other": 1} and null pass."""
    for options in ({"include_usage": True}, {"include_usage": False, "other": 1}, None):
        taken_by_tiny(stream_options=options)


def test_the_depth_of_a_body_with_more_brackets_than_the_limit_is_exact() -> None:
    """Bodies with more brackets than the limit (some in strings): their depth, at every depth."""
    rnd = random.Random(7)

    def deepest(value: Any) -> int:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        return (1 + max(map(deepest, children), default=0)) if isinstance(value, (dict, list)) else 0

    for depth in (*range(MAX_DEPTH - 3, MAX_DEPTH + 4), 60, 200, 250):
        value: Any = "[{"
        for level in range(depth):
            siblings = [[{"x": "]"}] for _ in range(rnd.randint(0, 2))]
            value = {"k": value, "s": siblings} if level % 2 else [*siblings, value]
        body = orjson.dumps({"model": "m", "v": value})
        assert body.count(b"[") + body.count(b"{") > MAX_DEPTH
        doc = orjson.loads(body)
        assert nesting_depth(body) == deepest(doc)


def test_field_checks_built_once_for_a_route_check_each_endpoint_s_own_fields() -> None:
    """A route's FieldChecks, built once, check /completions' own logprobs count there and nowhere else."""
    fields = FieldChecks(LLAMACPP)
    completion = {"model": "m", "prompt": "hi", "logprobs": 2}
    assert check_request(completion, b"/completions", LLAMACPP, fields) == ()
    with pytest.raises(HTTPError) as info:
        check_request({**completion, "messages": [{"role": "user"}]}, b"/chat/completions", LLAMACPP, fields)
    assert info.value.param == "logprobs"
    assert fields.of(b"/embeddings") is fields.of(b"/chat/completions")  # no fields of their own


def test_a_key_given_twice_cannot_hide_its_first_value_s_depth() -> None:
    """orjson keeps the last of two "messages"; the engine's parser reads the first, 1000 deep, too: 400."""
    deep = b"[" * 1000 + b"]" * 1000
    body = b'{"model":"m","messages":' + deep + b',"messages":[{"role":"user","content":"hi"}]}'
    assert orjson.loads(body)["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(HTTPError) as info:
        parse_request(body)
    assert info.value.code == "nested_too_deep"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","prompt":"p","temperature":9223372036854775808}',
        b'{"model":"m","prompt":"p","temperature":1000000000000000000000000000000}',
        b'{"model":"m","prompt":"p","presence_penalty":-1000000000000000000000000000000}',
        b'{"model":"m","prompt":"p","frequency_penalty":18446744073709551615}',
        b'{"model":"m","prompt":"p","repetition_penalty":9007199254740993}',
    ],
)
def test_a_number_field_past_2_to_the_53_is_refused(body: bytes) -> None:
    """Numbers mlx's batch step casts (std::bad_cast from 2**63), and literals orjson reads as floats
    but an engine's json.loads as ints: refused past 2**53 where the spec sets no bound of its own."""
    with pytest.raises(HTTPError) as info:
        model_of(body, b"/completions", TINY)
    assert info.value.status == 400
    assert "9007199254740992" in info.value.message


def test_numbers_up_to_2_to_the_53_and_bounded_integers_are_taken() -> None:
    """A temperature of 2, a penalty of -2**53, a seed of 2**64 - 1; max_tokens past 2**31 - 1 is refused
    for a model whose context is unknown."""
    taken_by_tiny(temperature=2.0, presence_penalty=-(2**53), seed=2**64 - 1)
    with pytest.raises(HTTPError, match="2147483647"):
        model_of(body_of(model="m", max_tokens=2**31), b"/chat/completions", MLX)


def test_the_openers_are_counted_exactly_up_to_one_past_the_limit() -> None:
    """``_openers``: the count of ``[`` and ``{``, as ``count`` gives it, up to one past the limit."""
    rnd = random.Random(11)
    for _ in range(300):
        body = bytes(rnd.choice(b'[]{}"ab, ') for _ in range(rnd.randint(0, 400)))
        every = body.count(b"[") + body.count(b"{")
        for limit in (0, 3, MAX_DEPTH):
            assert _openers(body, limit) == min(every, limit + 1)
            assert _openers(bytearray(body), limit) == min(every, limit + 1)
