"""A request's structured-output fields -> `StructuredOutputParams`: OpenAI's `response_format`
(text, json_object, json_schema) and vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, on both endpoints. At most one may constrain a request.

Each constraint remembers the request field it came from, so that an error the engine finds
later (a schema or grammar its backend cannot compile, raised as SamplingParamsError naming
`structured_output.<kind>`) is answered naming the field the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.entrypoints.openai.protocol import RequestFieldError
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputParams
    field: str  # the request field it came from ("response_format.json_schema.schema", "guided_regex", ...)

    def field_error(self, e: SamplingParamsError) -> RequestFieldError:
        """The engine's error about this constraint, naming the request's field."""
        return RequestFieldError(self.field, str(e).replace(e.field, self.field))


def constraint_of(req) -> Constraint | None:
    """The request's one constraint, or None. Raises RequestFieldError naming the field."""
    given: list[tuple[str, dict]] = []
    if req.response_format is not None:
        given += _response_format(req.response_format)
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            given.append((field, {kind: value}))
    if not given:
        return None
    if len(given) > 1:
        raise RequestFieldError(given[1][0].split(".")[0], "only one structured-output constraint may be given, got "
                                + " and ".join(f.split(".")[0] for f, _ in given))
    field, kwargs = given[0]
    return Constraint(build(field, **kwargs), field)


def build(field: str, **kwargs) -> StructuredOutputParams:
    try:
        return StructuredOutputParams(**kwargs)
    except SamplingParamsError as e:
        raise RequestFieldError(field, str(e).replace(e.field, field)) from None


def _response_format(value: dict) -> list[tuple[str, dict]]:
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise RequestFieldError(f"response_format.{sorted(extra)[0]}", f"unknown field response_format.{sorted(extra)[0]}")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", {"json_object": True})]
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestFieldError("response_format.json_schema", "response_format.json_schema must be an object "
                                    '{"name", "schema", "strict"} when type is "json_schema"')
        unknown = set(spec) - _JSON_SCHEMA_KEYS
        if unknown:
            field = f"response_format.json_schema.{sorted(unknown)[0]}"
            raise RequestFieldError(field, f"unknown field {field}")
        if not isinstance(spec.get("schema"), dict):
            raise RequestFieldError("response_format.json_schema.schema",
                                    f"response_format.json_schema.schema must be a JSON schema object, got {spec.get('schema')!r:.100}")
        return [("response_format.json_schema.schema", {"json": spec["schema"]})]
    raise RequestFieldError("response_format.type", 'response_format.type must be "text", "json_object" or '
                                                    f'"json_schema", got {kind!r}')
