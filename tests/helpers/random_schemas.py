"""JSON Schemas drawn at random, for property tests of structured outputs.

Every schema is an object at the top; leaves are bounded strings, integer ranges, booleans,
nulls and enums; inner nodes are objects (some properties required, no others allowed) and
arrays (at most a few items). Bounds keep every valid document short, so a constrained
generation always has room to finish. Seeded: the same seed gives the same schemas.
"""

from __future__ import annotations

import random
import string
from typing import Any

NAMES = [*string.ascii_lowercase[:12], "id", "name", "tags", "value", "items", "ok"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "null", "enum", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        values: list[Any] = rng.sample(["red", "green", "blue", "x y", "", 1, 2.5, True, None], rng.randint(1, 4))
        return {"enum": values}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One schema; `depth` 0 is the top (always an object)."""
    if depth > 0 and (depth >= 3 or rng.random() < 0.55):
        return _leaf(rng)
    if depth > 0 and rng.random() < 0.3:
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(NAMES, rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
