"""Random JSON schemas from random example values (each schema validated against its example), for the
structured-output tests of the engine and of the whole API."""

import random
import string
from typing import Any

import jsonschema

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "north", "south", "on", "off", "x1", "ok"]


def random_value(rng: random.Random, depth: int = 0) -> tuple[str, Any]:
    """(kind, example value): kind picks the schema shape derived from the value. The top level is
    an object; objects and arrays nest two levels at most."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] * 2 if depth < 2 else [])
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "string":
        return kind, "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(0, 6)))
    if kind == "integer":
        return kind, rng.randint(-500, 500)
    if kind == "number":
        return kind, round(rng.uniform(-50, 50), 2)
    if kind == "boolean":
        return kind, rng.random() < 0.5
    if kind == "enum":
        return kind, rng.choice(_WORDS)
    if kind == "array":
        item_kind, first = random_value(rng, depth + 1)
        return kind, (item_kind, [first])
    keys = rng.sample(["id", "name", "size", "tags", "flag", "kind", "price", "child"], rng.randint(2, 4) if depth == 0 else rng.randint(1, 3))
    return kind, {k: random_value(rng, depth + 1) for k in keys}


def schema_of(rng: random.Random, kind: str, value: Any) -> tuple[dict[str, Any], Any]:
    """(schema, the example as plain JSON) for one example value."""
    if kind == "string":
        return {"type": "string", "maxLength": max(len(value), rng.randint(1, 8))}, value
    if kind == "integer":
        return {"type": "integer", "minimum": min(value, -10), "maximum": max(value, 999)}, value
    if kind == "number":
        return {"type": "number", "minimum": -100, "maximum": 100}, value
    if kind == "boolean":
        return {"type": "boolean"}, value
    if kind == "enum":
        return {"type": "string", "enum": sorted({value, *rng.sample(_WORDS, 2)})}, value
    if kind == "array":
        item_kind, items = value
        item_schema, item = schema_of(rng, item_kind, items[0])
        return {"type": "array", "items": item_schema, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}, [item]
    properties, example = {}, {}
    for key, (sub_kind, sub_value) in value.items():
        properties[key], example[key] = schema_of(rng, sub_kind, sub_value)
    required = sorted(rng.sample(sorted(properties), rng.randint(1, len(properties))))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}, example


def random_schemas(n: int, seed: int = 2024) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    schemas = []
    while len(schemas) < n:
        schema, example = schema_of(rng, *random_value(rng))
        jsonschema.validate(example, schema)  # the generator itself is consistent
        schemas.append(schema)
    return schemas
