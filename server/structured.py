"""Structured output: request fields → the engine's plain-data constraint spec.

The spec is compiled by the engine (engine.constrain); a schema the grammar engine cannot
compile comes back from `client.submit` as EngineError(400) with the reason, which the endpoints
turn into their own 400 shape. Here we only check the request's shape.

    {"type": "text"}                                           → None
    {"type": "json_object"}                                    → {"type": "json_object"}
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   (chat completions)
    {"type": "json_schema", "name", "schema", "strict"}                   (Responses' text.format)
                                                               → {"type": "json_schema", ...}

The schema is always enforced token by token. `strict: true` also rejects (400) keywords the
grammar engine cannot enforce; without it (OpenAI's default, false) they are ignored. A schema
that is invalid (bad type, bad regex, dangling $ref) is a 400 either way.
"""

from __future__ import annotations

from typing import Any

from server.errors import bad_request


def response_format_constraint(rf: Any, param: str = "response_format") -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request(f"'{param}' must be an object", param)
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "json_schema" not in rf and "schema" not in rf:
            raise bad_request(f"'{param}' of type json_schema needs a 'json_schema' object",
                              f"{param}.json_schema")
        inner = rf.get("json_schema", rf)  # chat nests it; Responses' text.format does not
        if not isinstance(inner, dict):
            raise bad_request(f"'{param}.json_schema' must be an object", f"{param}.json_schema")
        schema = inner.get("schema")
        if schema is None:
            schema = {}
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"'{param}' schema must be a JSON Schema object", f"{param}.json_schema.schema")
        return {"type": "json_schema", "schema": schema, "strict": bool(inner.get("strict"))}
    if kind == "regex":  # extension
        pattern = rf.get("pattern")
        if not isinstance(pattern, str):
            raise bad_request(f"'{param}.pattern' must be a string", f"{param}.pattern")
        return {"type": "regex", "pattern": pattern}
    raise bad_request(
        f"unknown {param} type {kind!r}: expected text, json_object or json_schema", f"{param}.type"
    )
