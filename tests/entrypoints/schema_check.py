"""Validate JSON against a schema in the tests: with `jsonschema` when it is installed, else with
the subset of JSON Schema the tests' schemas use (type, properties, required,
additionalProperties: false, enum, const, maxLength, anyOf), so the checks run either way."""

from __future__ import annotations

_TYPES = {"object": dict, "string": str, "boolean": bool, "array": list, "null": type(None)}


class SchemaError(AssertionError):
    pass


def validate(instance, schema: dict) -> None:
    """Raises SchemaError (an AssertionError) when instance does not satisfy schema."""
    try:
        import jsonschema
    except ImportError:
        _check(instance, schema, "$")
        return
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as e:
        raise SchemaError(str(e)) from None


def _check(value, schema: dict, where: str) -> None:
    known = {"type", "properties", "required", "additionalProperties", "enum", "const", "maxLength", "anyOf",
             "description"}
    assert not set(schema) - known, f"schema_check does not implement {set(schema) - known}"
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                _check(value, option, where)
                return
            except SchemaError:
                pass
        raise SchemaError(f"{where}: {value!r} matches none of anyOf")
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool))):
        raise SchemaError(f"{where}: {value!r} is not of type {kind}")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{where}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        raise SchemaError(f"{where}: {value!r} is not {schema['const']!r}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise SchemaError(f"{where}: {value!r} is longer than {schema['maxLength']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                raise SchemaError(f"{where}: {key!r} is required")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                raise SchemaError(f"{where}: {key!r} is not allowed")
