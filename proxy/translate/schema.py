"""Tool parameter schemas as a chat engine's template can take them.

Agent clients write their tools' ``input_schema``/``parameters`` for a
hosted model: JSON Schema 2020-12 with ``$schema``, ``propertyNames``,
``const``... A local engine renders tools into its chat template, or turns a
schema into a grammar, and both know a subset. The keywords below say nothing
a small model needs and are left out, at every level of the schema; the
rest (types, properties, required, enum, descriptions, anyOf) stays.
"""

from __future__ import annotations

from typing import Any

# Annotations and meta-schema keywords: the schema's own bookkeeping, not its shape.
DROPPED_KEYWORDS = frozenset({"$schema", "$id", "$comment", "propertyNames", "examples", "deprecated"})


def clean_schema(schema: Any) -> Any:
    """``schema`` without ``DROPPED_KEYWORDS``, at any depth; a new value, the input unchanged.

    Only keywords are dropped: a property *named* like one (``properties``'
    keys) stays.
    """
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key in DROPPED_KEYWORDS:
                continue
            if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
                out[key] = {name: clean_schema(sub) for name, sub in value.items()}
            else:
                out[key] = clean_schema(value)
        return out
    if isinstance(schema, list):
        return [clean_schema(item) for item in schema]
    return schema
