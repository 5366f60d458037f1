"""Default bounds for a JSON schema's open-ended numbers and strings, so that an ordinary schema finishes.

A schema's `{"type": "number"}` allows digits without end, and a small model, once it writes `1`, may go on
writing `1`s until max_tokens: the output is then cut off and not JSON. So where a schema leaves a number or
a string open, its grammar gets bounds (the schema the client sent, and its hash, stay as they are):

- a number or an integer: within +-NUMBER_LIMIT (16 digits before the point), and a number at most
  DECIMALS digits after it (multipleOf 1e-DECIMALS: no exponent);
- a string: at most STRING_CHARS characters.

Whatever a schema says itself wins: a field's own `minimum` / `maximum` (or the exclusive ones),
`multipleOf`, `maxLength`, `pattern`, `format`, `enum` or `const` leaves that side as the schema has it, so a
client lifts a bound by stating its own (`"maxLength": 100000`).
"""

from __future__ import annotations

NUMBER_LIMIT = 10**15
DECIMALS = 8
STRING_CHARS = 1024

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords whose value is a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # ... a map of name -> schema
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "if", "then", "else")  # ... one schema
_FIXED = ("enum", "const")  # a value given outright: nothing to bound


def bounded(schema):
    """A copy of `schema` with the defaults above where it leaves numbers or strings open (`not`
    subschemas are left alone: bounding them would widen what they exclude)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded(s) for name, s in out[key].items()}
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = bounded(out[key])
    if any(k in out for k in _FIXED):
        return out
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types & {"number", "integer"}:
        _bound_number(out, integer_only="number" not in types)
    if "string" in types and not any(k in out for k in ("maxLength", "pattern", "format")):
        out["maxLength"] = STRING_CHARS
    return out


def _bound_number(schema: dict, integer_only: bool) -> None:
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -NUMBER_LIMIT
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = NUMBER_LIMIT
    if not integer_only and "multipleOf" not in schema:
        schema["multipleOf"] = 10.0**-DECIMALS
