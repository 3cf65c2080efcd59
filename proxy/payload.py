"""Reading the request body: the one place the gateway looks inside it.

The body is parsed once, for routing, and forwarded as the client's bytes.
Besides ``model``, it is checked against what the engine behind the route
takes: the fields its spec declares, with their types and ranges, and the
ones that would make it load something (mlx_lm.server's generation thread
dies for good on ``max_tokens: 0``, and closes the socket on a field it
cannot take; see shared/design.md). Checking reads the body; the few changes
the gateway makes to it are spliced in by ``proxy.splice``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any, Final, Protocol

import orjson

from proxy.errors import HTTPError

_TOKEN_LIMIT_FIELDS: Final = ("max_tokens", "max_completion_tokens")


# The deepest nesting of arrays and objects a body may have, for every route.
# Parsing takes 1024 levels (orjson's own limit), and mlx_lm.server's json
# loads fails near 1000 (its empty reply); 128 is serde_json's default, and
# far more than any request's tools schemas use.
MAX_DEPTH: Final = 128
# A field's bound: an int stays one (and is written as one in an error), compiled or not (a
# ``float`` annotation would make it a C double in compiled code: 2**53 written 9.0072e+15).
Bound = int | float


class RequestField(Protocol):
    """What the request path reads of one field a route's engine declares (``engines.spec.RequestField``)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def low(self) -> Bound | None: ...
    @property
    def high(self) -> Bound | None: ...
    @property
    def high_fact(self) -> tuple[str, int] | None: ...
    @property
    def min_length(self) -> int | None: ...
    @property
    def max_length(self) -> int | None: ...
    @property
    def max_items(self) -> int | None: ...
    @property
    def refused_keys(self) -> frozenset[str]: ...
    @property
    def members(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def takes_null(self) -> bool: ...
    @property
    def loads(self) -> bool: ...
    @property
    def endpoint(self) -> str: ...


class RequestGuards(Protocol):
    """What the request path reads of a route's guards: checks and handling its engine needs.

    Only the names and types: each guard's default and meaning are written
    once, in ``engines.spec.Guards``, the object the composition root hands
    to every route (the request path may not import ``engines``; mypy checks
    that the one fits the other).
    """

    # Hashable, as a frozen dataclass is: routes are compared and looked up by value on a reload.
    def __hash__(self) -> int: ...

    @property
    def min_max_tokens(self) -> int: ...
    @property
    def require_input(self) -> bool: ...
    @property
    def fields(self) -> tuple[RequestField, ...]: ...
    @property
    def allowed(self) -> frozenset[str]: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def context_length(self) -> int | None: ...
    @property
    def via_stream(self) -> bool: ...
    @property
    def stream_cannot_carry(self) -> tuple[str, ...]: ...
    @property
    def native_apis(self) -> tuple[str, ...]: ...
    @property
    def max_tokens(self) -> int | None: ...


def _too_deep() -> HTTPError:
    return HTTPError(
        400,
        f"request body nests arrays and objects more than {MAX_DEPTH} levels deep; "
        f"the gateway takes at most {MAX_DEPTH}",
        code="nested_too_deep",
    )


# For nesting_depth: brackets as steps up (1) and down (-1 as a signed byte); every other byte deleted.
_STEPS: Final = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS: Final = bytes(set(range(256)) - set(b"[]{}"))


def nesting_depth(body: bytes | bytearray) -> int:
    """How deep the arrays and objects of the JSON text ``body`` nest (brackets in strings not counted).

    Exact for valid JSON, which is all it is asked about. Counted on the
    bytes, not on the parsed document: a key given twice is parsed once (the
    last), but the engine's own parser reads the body as sent, the nesting of
    a duplicate that orjson dropped included. Cheap where it cannot matter: a
    body with at most MAX_DEPTH opening brackets in all is not walked (their
    count is returned, a bound on its depth).
    """
    opened = _openers(body, MAX_DEPTH)
    if opened <= MAX_DEPTH:
        return opened
    if b"\\" in body:
        # Escapes cannot hide a quote from the split: \\ and \" become two other bytes.
        body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    outside_strings = b"".join(body.split(b'"')[::2])
    steps = array("b", outside_strings.translate(_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0)


def _openers(body: bytes | bytearray, limit: int) -> int:
    """How many ``[`` and ``{`` ``body`` holds, counted up to one past ``limit``: found one by one
    (``find`` skips the bytes between with memchr, many bytes at a time), where ``count``
    looks at every byte, twice; a body of many brackets is left at the first past ``limit``."""
    opened = 0
    for opener in (b"[", b"{"):
        at = body.find(opener)
        while at >= 0:
            opened += 1
            if opened > limit:
                return opened
            at = body.find(opener, at + 1)
    return opened


def parse_request(body: bytes | bytearray) -> tuple[str, dict[str, Any]]:
    """The ``model`` field and the parsed body, or a 400."""
    if not body:
        raise HTTPError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise _too_deep() from None
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if nesting_depth(body) > MAX_DEPTH:
        raise _too_deep()
    if not isinstance(doc, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    model = doc.get("model")
    if model is None:
        raise HTTPError(400, "you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str) or not model:
        raise HTTPError(400, "model must be a non-empty string", param="model", code="invalid_model")
    return model, doc


def ask_for_stream(doc: dict[str, Any], endpoint: bytes, guards: RequestGuards) -> bool:
    """Make a non-stream generation request a stream with usage; whether it was made one.

    Not for embeddings, and not when the request sets a field that the
    engine's streams do not carry (mlx: logprobs only in non-stream replies).
    """
    if endpoint not in _GENERATION_ENDPOINTS:
        return False
    for name in guards.stream_cannot_carry:
        value = doc.get(name)
        if value is not None and value is not False and value != 0:
            return False
    doc["stream"] = True
    doc["stream_options"] = {"include_usage": True}
    return True


_GENERATION_ENDPOINTS: Final = frozenset({b"/chat/completions", b"/completions"})


def check_request(
    doc: dict[str, Any], endpoint: bytes, guards: RequestGuards, fields: FieldChecks | None = None
) -> tuple[str, ...]:
    """Raise a 400 for what the route's engine must not receive; the null fields to leave out.

    ``fields`` are the guards' field checks, built once per route (built here if not given).
    """
    for field in _TOKEN_LIMIT_FIELDS:
        value = doc.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < guards.min_max_tokens
        ):
            raise HTTPError(
                400,
                f"{field} must be an integer of at least {guards.min_max_tokens}",
                param=field,
                code="invalid_value",
            )
    if guards.require_input:
        _check_input(doc, endpoint)
    if not guards.fields:
        return ()
    return check_fields(doc, endpoint, guards, FieldChecks(guards) if fields is None else fields)


def _check_input(doc: dict[str, Any], endpoint: bytes) -> None:
    if endpoint == b"/chat/completions":
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPError(400, "messages must be a non-empty list", param="messages", code="invalid_value")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise HTTPError(
                    400,
                    f"messages[{index}] must be an object with a string role",
                    param=f"messages[{index}]",
                    code="invalid_type",
                )
    elif endpoint == b"/completions" and not isinstance(doc.get("prompt"), (str, list)):
        raise HTTPError(400, "you must provide a prompt", param="prompt", code="invalid_value")


# A field's check: what it must be (for the message) and the test of a value.
_Check = tuple[str, Callable[[Any], bool], RequestField]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(key: str) -> bool:
    # Canonical decimal only: Python's int() also takes "+5", " 5", "1_0", "05" and other scripts' digits.
    return key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float))


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "boolean": ("true or false", lambda v: isinstance(v, bool)),
    "integer": ("an integer", _is_integer),
    "number": ("a number", _is_number),
    # Python's float: what a JSON number with a fraction or an exponent parses to.
    "float": ("a number written with a decimal point (0.0, not 0)", lambda v: isinstance(v, float)),
    "string": ("a string", lambda v: isinstance(v, str)),
    "strings": (
        "a string or a list of strings",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
    ),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "scalars": (
        "an object of strings, numbers, booleans or nulls",
        lambda v: isinstance(v, dict) and all(_is_scalar(m) for m in v.values()),
    ),
    "array": ("a list", lambda v: isinstance(v, list)),
    "bias": (
        "an object of numbers",
        lambda v: isinstance(v, dict) and all(_is_number(b) for b in v.values()),
    ),
}


# The largest magnitude a JSON number keeps exactly in every parser (2**53).
_EXACT_LIMIT: Final = 2**53


def _token_bias(vocab_size: int | None) -> tuple[str, Callable[[Any], bool]]:
    """Token ids (canonical decimal integers from 0, below the model's vocabulary where known) to numbers."""
    limit = (vocab_size or 1) - 1
    digits = len(str(limit))

    def ok(value: Any) -> bool:
        return isinstance(value, dict) and all(
            _is_token_id(k) and len(k) <= digits and int(k) <= limit and _is_number(b)
            for k, b in value.items()
        )

    if vocab_size is None:
        # An id past the vocabulary is written past the end of the logits (mlx: SIGSEGV); with no
        # config.json to read (a hub repo, a static upstream) no id is known to be safe.
        return (
            "empty: this model's vocabulary size is unknown to the gateway (it reads config.json "
            "beside an MLX model directory), so no token id can be checked",
            lambda value: value == {},
        )
    return (
        f"an object of token ids (integers from 0 to {limit}, the model's, written 0, 1, 2, ...) to numbers",
        ok,
    )


def _shown(number: Bound) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def _high(rule: RequestField, guards: RequestGuards) -> Bound | None:
    """The field's upper bound: its own, or the model's fact less its offset where lower (and known)."""
    if rule.high_fact is None:
        return rule.high
    fact, less = rule.high_fact
    known = {"vocab_size": guards.vocab_size, "context_length": guards.context_length}.get(fact)
    if known is None:
        return rule.high
    return known - less if rule.high is None else min(rule.high, known - less)


def _lengths(rule: RequestField) -> tuple[str, Callable[[Any], bool]] | None:
    """The rule's string lengths and list size, as words and a test; None if it sets none."""
    shortest, longest, most = rule.min_length, rule.max_length, rule.max_items
    if shortest is None and longest is None and most is None:
        return None
    words = []
    if most is not None:
        words.append(f"at most {most} in a list")
    if shortest is not None:
        words.append("not empty" if shortest == 1 else f"at least {shortest} characters each")
    if longest is not None:
        words.append(f"at most {longest} characters each")

    def fits(text: str) -> bool:
        return (shortest is None or len(text) >= shortest) and (longest is None or len(text) <= longest)

    def ok(value: Any) -> bool:
        if isinstance(value, str):
            return fits(value)
        return (most is None or len(value) <= most) and all(not isinstance(v, str) or fits(v) for v in value)

    return ", ".join(words), ok


_MEMBER_TESTS: dict[str, Callable[[Any], bool]] = {
    "boolean": lambda v: isinstance(v, bool),
    "integer": _is_integer,
    "number": _is_number,
    "string": lambda v: isinstance(v, str),
}


def _keys(rule: RequestField) -> tuple[str, Callable[[Any], bool]] | None:
    """The rule's refused keys and required members of an object, as words and a test; None if none."""
    refused, members = rule.refused_keys, rule.members
    if not refused and not members:
        return None
    words = []
    if members:
        words.append(", ".join(f"{name} {_KINDS[kind][0]}" for name, kind in members))
    if refused:
        words.append(f"none of the keys {', '.join(sorted(refused))}")

    def ok(value: Any) -> bool:
        return refused.isdisjoint(value) and all(
            name in value and _MEMBER_TESTS[kind](value[name]) for name, kind in members
        )

    return "; ".join(words), ok


def _check_of(rule: RequestField, guards: RequestGuards) -> _Check:
    expected, ok = _token_bias(guards.vocab_size) if rule.kind == "token_bias" else _KINDS[rule.kind]
    extra = [found for found in (_lengths(rule), _keys(rule)) if found is not None]
    if extra:
        of_kind = ok
        expected = f"{expected} ({'; '.join(words for words, _ in extra)})"
        tests = [test for _, test in extra]

        def shaped(value: Any) -> bool:
            return of_kind(value) and all(test(value) for test in tests)

        ok = shaped
    low, high = rule.low, _high(rule, guards)
    if rule.kind == "number":
        # JSON's interoperable range (RFC 7493): orjson parses an integer literal past 64 bits as
        # a float, which an engine's json.loads reads as an int (mlx: std::bad_cast from 2**63).
        low = -_EXACT_LIMIT if low is None else low
        high = _EXACT_LIMIT if high is None else high
    if low is None and high is None:
        return expected, ok, rule
    if high is None:
        expected = f"{expected} of at least {_shown(low or 0)}"
    elif low is None:
        expected = f"{expected} of at most {_shown(high)}"
    else:
        expected = f"{expected} from {_shown(low)} to {_shown(high)}"

    def in_range(value: Any) -> bool:
        return ok(value) and (low is None or value >= low) and (high is None or value <= high)

    return expected, in_range, rule


class FieldChecks:
    """A route's field checks, by endpoint: built once from its guards, with its route's entry."""

    __slots__ = ("_by_endpoint", "_every")

    def __init__(self, guards: RequestGuards) -> None:
        # Every endpoint's fields, then, for an endpoint that has its own, those too.
        self._every = {r.name: _check_of(r, guards) for r in guards.fields if not r.endpoint}
        self._by_endpoint: dict[bytes, dict[str, _Check]] = {}
        for rule in guards.fields:
            if rule.endpoint:
                own = self._by_endpoint.setdefault(rule.endpoint.encode(), dict(self._every))
                own[rule.name] = _check_of(rule, guards)

    def of(self, endpoint: bytes) -> dict[str, _Check]:
        """The checks of the fields ``endpoint`` takes."""
        return self._by_endpoint.get(endpoint, self._every)


def check_fields(
    doc: dict[str, Any], endpoint: bytes, guards: RequestGuards, fields: FieldChecks
) -> tuple[str, ...]:
    """A 400 naming the first declared field the engine cannot take; the null fields to leave out.

    A field that makes the engine load something is refused unless the
    model allows it. One loop over the body's own fields (a handful, against
    some thirty declared), in the client's order, a dict lookup each.
    """
    nulls: list[str] = []
    checks = fields.of(endpoint)
    for field, value in doc.items():
        check = checks.get(field)
        if check is None:
            continue
        expected, ok, rule = check
        if value is None:
            if not rule.takes_null:
                nulls.append(field)
            continue
        if rule.loads and field not in guards.allowed:
            raise HTTPError(
                400,
                f"{field} makes the engine load what it names, which this model does not allow "
                f"(the gateway's config can, with allow-fields = [{orjson.dumps(field).decode()}] "
                "in the model's table)",
                param=field,
                code="field_not_allowed",
            )
        if not ok(value):
            raise HTTPError(
                400,
                f"{field} must be {expected}, not {orjson.dumps(value).decode()[:80]}",
                param=field,
                code="invalid_type",
            )
    return tuple(nulls)


def extract_model(body: bytes, endpoint: bytes, guards: RequestGuards) -> str:
    """Return the ``model`` field of a JSON request body, or raise a 400."""
    model, doc = parse_request(body)
    check_request(doc, endpoint, guards)
    return model
