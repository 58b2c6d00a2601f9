"""The router's OpenAPI document names the request body of every POST endpoint.

The endpoints read their bodies themselves (`serving.read_body`: a size limit, OpenAI error JSON for
bad JSON), so FastAPI does not see the models and would publish no request body at all: clients,
generators and fuzzers (schemathesis) would have nothing to go on. vLLM's server publishes them;
so does this, from the same pydantic models the endpoints parse with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def publish_request_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` describe each POST `path`'s JSON body as its model (`bodies`: path -> model)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template=_REF, mode="validation")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
