"""Reading the request body: the one place the gateway looks inside it.

The body is parsed once, for routing, and forwarded as the client's bytes.
Besides ``model``, only the few fields that would break the engine behind us
are checked here (mlx_lm.server's generation thread dies for good on
``max_tokens: 0``; see shared/design.md).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import HTTPError

_TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


def extract_model(body: bytes) -> str:
    """Return the ``model`` field of a JSON request body, or raise a 400."""
    if not body:
        raise HTTPError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    model = doc.get("model")
    if model is None:
        raise HTTPError(400, "you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str) or not model:
        raise HTTPError(400, "model must be a non-empty string", param="model", code="invalid_model")
    for field in _TOKEN_LIMIT_FIELDS:
        value = doc.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HTTPError(
                400,
                f"{field} must be an integer of at least 1",
                param=field,
                code="invalid_value",
            )
    return model
