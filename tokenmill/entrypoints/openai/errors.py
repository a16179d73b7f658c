"""What the server answers when a request fails: OpenAI's error body (`error_response`), the
exception handlers that answer every failure with one (400, not FastAPI's 422, for a bad body,
with `param` naming the request field as OpenAI's does), and the OpenAPI schema that documents
those answers."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Union, get_args, get_origin

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_llm import EngineDeadError, RequestAbortedError
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.serving import APIError


def error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app raises answered with an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
        model = _BODY_MODELS.get(request.url.path)
        param = _error_param(model, first.get("loc", ()))
        # A union field fails once per member ("temperature.float", "temperature.int"); a member
        # that took the type but broke a constraint (17 stop strings: too_long) says the most.
        same = [err for err in errors if _error_param(model, err.get("loc", ())) == param]
        first = next((err for err in same if not str(err.get("type", "")).endswith("_type")), first)
        msg = first.get("msg", "invalid value")
        where = f"{param}: " if param else "request body: "
        return error_response(400, f"{where}{msg} (got {_short(first.get('input'))})", param)

    @app.exception_handler(ValueError)
    async def _value_error(request, e: ValueError):
        return error_response(400, str(e), getattr(e, "field", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        if isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", made specific
            bad = e.__cause__
            return error_response(400, f"request body is not valid JSON: it is not valid UTF-8 (byte "
                                       f"{bad.object[bad.start]:#04x} at position {bad.start}: {bad.reason})")
        return error_response(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestAbortedError)
    async def _engine_gone(request, e: Exception):
        return error_response(503, str(e), type="server_error")


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema with the answers the server gives: errors in OpenAI's shape (400 where
    FastAPI would say 422), the limits' 413 and 431, streams as server-sent events."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
    }
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    reasons = {"400": "invalid request (the error's param names the field)", "401": "missing or wrong API key",
               "404": "unknown model", "413": "request body over --max-request-body-bytes",
               "429": "too many requests queued", "431": "request headers over --max-header-bytes or --max-header-count",
               "503": "loading, shutting down or the engine stopped"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            statuses = ["400", "413", "431"]
            if path in _BODY_MODELS:
                statuses += ["401", "404", "503"] + (["429"] if path.startswith("/v1/") else [])
            elif path == "/v1/models":
                statuses += ["401"]
            elif path == "/health":
                statuses += ["503"]
            for status in sorted(statuses):
                responses[status] = {"description": reasons[status], **error}
            if path in ("/v1/completions", "/v1/chat/completions"):
                responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    app.openapi_schema = schema
    return schema


# The request body of each endpoint that takes one (routes.py), for a validation error's `param`.
_BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def _error_param(model: type[BaseModel] | None, loc) -> str | None:
    """The request field (or query parameter) a validation error's location names, as OpenAI's
    `param`: field names and list indices into nested messages ("messages.0.role"). Pydantic's
    location goes on with the union member it tried ("temperature.float", "prompt.str") and with
    list indices and map keys inside plain values ("logit_bias.5.float"); those are cut off."""
    loc = [p for p in loc if p not in ("body", "query")]
    if model is None:
        return str(loc[0]) if loc else None
    parts: list[str] = []
    i = 0
    while model is not None and i < len(loc) and isinstance(loc[i], str) and loc[i] in model.model_fields:
        parts.append(loc[i])
        model, is_list = _nested_model(model.model_fields[loc[i]].annotation)
        i += 1
        if model is not None and is_list:
            if i < len(loc) and isinstance(loc[i], int):
                parts.append(str(loc[i]))
                i += 1
            else:
                break
    return ".".join(parts) or None


def _nested_model(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(the model a field holds, whether as a list of them), or (None, False) for plain values."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _nested_model(get_args(annotation)[0])
    if origin is Union or origin is UnionType:
        members = [a for a in get_args(annotation) if a is not type(None)]
        return _nested_model(members[0]) if len(members) == 1 else (None, False)
    if origin is list:
        inner, _ = _nested_model(get_args(annotation)[0])
        return (inner, True) if inner is not None else (None, False)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
