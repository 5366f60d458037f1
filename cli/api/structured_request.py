"""An OpenAI request's structured-output fields -> `SamplingParams.structured` (protocol side, pure).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", ...}), and vLLM's extension
fields `guided_json` (a schema, object or JSON text), `guided_regex`, `guided_choice` (a list of strings)
and `guided_grammar` (Lark or GBNF). At most one may ask for structure. Bad values raise JaxsmolError with
a message naming the field (the daemon answers 400 with it).

The daemon wires it in one line: `SamplingParams(..., structured=structured_from_request(body))`, `body`
being the request as a dict.
"""

from __future__ import annotations

import json

from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.structured import canonical_spec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided_spec(field: str, value) -> dict:
    """The spec dict for one vLLM guided_* field; JaxsmolError naming the field for a bad shape."""
    if field == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise JaxsmolError(f"guided_json is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise JaxsmolError("guided_json must be a JSON schema (an object)")
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": value}}
    if field == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise JaxsmolError("guided_choice must be a non-empty list of strings")
        return {"type": "choice", "choice": value}
    if not isinstance(value, str) or not value:
        raise JaxsmolError(f"{field} must be a non-empty string")
    kind = field.removeprefix("guided_")
    return {"type": kind, kind: value}


def _named(field: str, spec) -> str | None:
    """canonical_spec, its error message naming the request field."""
    try:
        return canonical_spec(spec)
    except JaxsmolError as e:
        message = str(e)
        raise JaxsmolError(message if message.startswith(field) else f"{field}: {message}") from None


def structured_from_request(body: dict) -> str | None:
    """The canonical spec for a chat or completions request body, or None for free text."""
    specs = []
    if body.get("response_format") is not None:
        spec = _named("response_format", body["response_format"])
        if spec is not None:  # {"type": "text"} asks for nothing
            specs.append(("response_format", spec))
    for field in GUIDED_FIELDS:
        if body.get(field) is not None:
            specs.append((field, _named(field, _guided_spec(field, body[field]))))
    if len(specs) > 1:
        raise JaxsmolError(f"give only one of {', '.join(name for name, _ in specs)}")
    return specs[0][1] if specs else None
