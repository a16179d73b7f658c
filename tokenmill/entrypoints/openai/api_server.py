"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

One process: uvicorn's event loop answers HTTP, an `AsyncLLM` steps the engine on its own
thread. The model loads in the background after the socket is open (`/health` answers 503
until it is ready). SIGTERM/SIGINT drain: new requests get 503, running ones get up to
`--shutdown-timeout` seconds to finish, the rest are aborted, and the process exits 0. When the
engine dies (a step raised, or ran past `--engine-step-timeout`), every request gets an error,
/health answers 503, and the process exits with status 1 `DEAD_EXIT_GRACE` seconds later, for a
supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError, RequestAbortedError
from tokenmill.entrypoints.openai.args import PROMPT_CHARS_PER_TOKEN, ServerConfig
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_request,
)
from tokenmill.entrypoints.openai.serving import APIError, ClientDisconnected, OpenAIServing
from tokenmill.entrypoints.openai.stats_stream import DEFAULT_INTERVAL, MAX_INTERVAL, MIN_INTERVAL, StatsStream
from tokenmill.entrypoints.openai.templates import read_template
from tokenmill.entrypoints.openai.tool_calls import tools_in_template
from tokenmill.entrypoints.web import web_routes
from tokenmill.version import __version__

logger = logging.getLogger(__name__)


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig):
        self.config = config
        self.model_name = config.served_model_name or engine_config.model
        # Read and parsed before the model loads, so that a missing or broken file stops the server at once.
        self.chat_template = read_template(config.chat_template) if config.chat_template else None
        if self.chat_template is not None:
            tools_in_template(self.chat_template)
        self.llm = AsyncLLM(engine_config, log_stats_interval=config.log_stats_interval,
                            step_timeout=config.engine_step_timeout or None)
        self.metrics = ServerMetrics(self.llm, self.model_name)
        self.stats_stream = StatsStream(self.llm, self.metrics, self.model_name)
        self.serving: OpenAIServing | None = None
        self.draining = False
        self.started = time.time()


def error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(engine_config: EngineConfig, config: ServerConfig) -> FastAPI:
    state = ServerState(engine_config, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.llm.start()
        asyncio.ensure_future(_when_ready())
        yield
        state.llm.shutdown()

    async def _when_ready():
        try:
            engine = await state.llm.wait_ready()
        except BaseException:  # noqa: BLE001 - logged by the engine thread; /health stays 503
            return
        max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_model_len
        state.serving = OpenAIServing(state.llm, engine, state.model_name, state.metrics, state.chat_template,
                                      max_prompt_chars=max_prompt_chars)
        logger.info("serving %s on http://%s:%d", state.model_name, config.host, config.port)

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.server = state
    add_request_limits(app, config)
    app.openapi = lambda: _openapi(app)

    # -- errors ------------------------------------------------------------------------------------

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

    # -- guards --------------------------------------------------------------------------------------

    def serving() -> OpenAIServing:
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error")
        if state.serving is None:
            if state.llm.load_error is not None:
                raise APIError(503, f"the model failed to load: {state.llm.load_error}", type="server_error")
            raise APIError(503, "the model is still loading", type="server_error", headers={"Retry-After": "5"})
        return state.serving

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           type="authentication_error", code="invalid_api_key")

    def check_capacity() -> None:
        waiting = state.llm.num_unfinished - state.llm.stats.num_running
        if waiting >= config.max_waiting_requests:
            raise APIError(429, f"too many requests queued ({waiting}); retry shortly",
                           type="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})

    async def disconnected(request: Request) -> None:
        """Returns when the client closes the connection (the body has been read already)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def generate(request: Request, handler, body):
        """Run `handler(serving, body, is_disconnected)` behind the guards: a JSON answer, or SSE."""
        check_auth(request)
        check_request(body)
        s = serving()
        check_capacity()
        try:
            result = await handler(s, body, lambda: disconnected(request))
        except ClientDisconnected:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- OpenAI endpoints ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, OpenAIServing.completions, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(request, OpenAIServing.chat_completions, body)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "tokenmill",
            "max_model_len": state.serving.engine.max_model_len if state.serving else None,
        }]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        check_auth(request)
        check_request(body)
        s = serving()
        s.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        engine = s.engine
        if body.messages is not None:
            text = s.chat_template.render(body.messages)
            s.check_prompt_length(text, "messages")
            tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            s.check_prompt_length(body.prompt, "prompt")
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        check_auth(request)
        check_request(body)
        s = serving()
        s.check_model(body.model)
        vocab = s.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": s.engine.tokenizer.decode(body.tokens)}

    # -- operations ------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if state.draining:
            return error_response(503, "shutting down", type="server_error")
        if state.llm.dead_error is not None:
            return error_response(503, f"the engine stopped: {state.llm.dead_error!r}", type="server_error")
        if state.serving is None:
            return error_response(503, "loading" if state.llm.load_error is None else f"load failed: {state.llm.load_error}",
                                  type="server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # Left out of the OpenAPI schema: it never ends, which a client generated from it would not expect.
    @app.get("/stats/stream", include_in_schema=False)
    async def stats_stream(request: Request, interval: float = DEFAULT_INTERVAL):
        check_auth(request)
        if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
            raise APIError(400, f"interval must be in [{MIN_INTERVAL:g}, {MAX_INTERVAL:g}] seconds, got {interval:g}",
                           param="interval")
        events = state.stats_stream.events(interval, lambda: state.draining or state.llm.dead_error is not None)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    if config.web_ui:
        app.router.routes.extend(web_routes())
    return app


def add_request_limits(app, config: ServerConfig) -> None:
    """413 and 431 (OpenAI error bodies) for requests over the body and header limits (also the
    data-parallel front end's, so that it answers them as one server does)."""
    app.add_middleware(_BodySizeLimit, limit=config.max_request_body_bytes)
    app.add_middleware(_HeaderLimit, max_bytes=config.max_header_bytes, max_count=config.max_header_count)


class _BodySizeLimit:
    """413 for request bodies over `limit` bytes, by Content-Length or as they stream in."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await _too_large(self.limit, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await _too_large(self.limit, send)


class _BodyTooLarge(StarletteHTTPException):
    # An HTTPException, so that FastAPI passes it on while reading the body (any other error
    # there becomes a 400 "error parsing the body") and the handler answers 413.
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes")


async def _too_large(limit: int, send) -> None:
    await _send_error(send, 413, f"request body is larger than {limit} bytes")


class _HeaderLimit:
    """431 for a request with more than `max_count` headers, or whose request line and headers
    together are over `max_bytes` (counted as sent: `name: value` lines). uvicorn's h11 parser
    stops a head that is still incomplete past that size plus HEAD_SLACK_BYTES (`_H11Protocol`),
    so this sees every head up to there."""

    def __init__(self, app, max_bytes: int, max_count: int):
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if len(headers) > self.max_count:
            return await _send_error(send, 431, f"the request has {len(headers)} headers; at most "
                                                f"{self.max_count} are allowed")
        size = head_size(scope)
        if size > self.max_bytes:
            return await _send_error(send, 431, f"the request line and headers are {size} bytes; at most "
                                                f"{self.max_bytes} are allowed")
        return await self.app(scope, receive, send)


def head_size(scope) -> int:
    """The bytes of a request's line and header lines as sent (`METHOD target HTTP/1.1`, `name: value`)."""
    query = scope.get("query_string", b"")
    target = len(scope.get("raw_path") or scope["path"].encode()) + (len(query) + 1 if query else 0)
    line = len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# Room past --max-header-bytes before the HTTP parser gives up on an incomplete request head, so
# that `_HeaderLimit` (which sees only complete heads) answers every head near the limit.
HEAD_SLACK_BYTES = 8 * 2**10


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with the errors it answers before the app sees a request (a
    request head over the parser's buffer, a request that is not HTTP) in the API's JSON shape:
    431 and 400 with an OpenAI error body instead of a plain-text 400."""

    def send_400_response(self, msg: str) -> None:
        pending, _ = self.conn.trailing_data
        if len(pending) > self.config.h11_max_incomplete_event_size:
            limit = self.config.h11_max_incomplete_event_size - HEAD_SLACK_BYTES
            status, message = 431, f"the request line and headers are larger than {limit} bytes"
        else:
            status, message = 400, "invalid HTTP request: the request line or headers could not be parsed"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def _openapi(app: FastAPI) -> dict:
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


# -- running it --------------------------------------------------------------------------------------


# Seconds a server whose engine died keeps answering (503s, and the errors of the requests it
# had) before it exits with status 1: time for in-flight responses to go out and for a health
# probe to see the 503.
DEAD_EXIT_GRACE = 2.0


class _DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains the engine before shutting down, and
    that exits with status 1 soon after its engine dies."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float):
        super().__init__(config)
        self.state = state
        self.timeout = timeout
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0
        self._dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.state.llm.dead_error is not None:
            now = time.monotonic()
            if self._dead_since is None:
                self._dead_since = now
                logger.error("the engine stopped (%r); exiting with status 1 in %gs",
                             self.state.llm.dead_error, DEAD_EXIT_GRACE)
            if now - self._dead_since >= DEAD_EXIT_GRACE:
                self.exit_code = 1
                return True
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_task is not None or self.should_exit:  # a second signal: stop now
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        logger.info("shutting down: no new requests; waiting up to %.0fs for %d running",
                    self.timeout, self.state.llm.num_unfinished)
        self.state.draining = True
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.llm.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.llm.num_unfinished:
            logger.warning("aborting %d requests still running at the shutdown timeout", self.state.llm.num_unfinished)
            self.state.llm.abort_all()
            await asyncio.sleep(0.2)  # let their handlers answer
        self.should_exit = True


def uvicorn_config(app, config: ServerConfig, log_level: str) -> uvicorn.Config:
    """How the server (and the data-parallel front end) listens: `--host`/`--port`, the header
    limits in the HTTP parser, a 5 s grace for open connections at shutdown."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                          timeout_graceful_shutdown=5, access_log=False, http=_H11Protocol,
                          h11_max_incomplete_event_size=config.max_header_bytes + HEAD_SLACK_BYTES)


def run_server(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info") -> int:
    app = build_app(engine_config, config)
    server = _DrainingServer(uvicorn_config(app, config, log_level), app.state.server, config.shutdown_timeout)
    server.run()
    if server.exit_code:
        # The engine thread may still be stuck inside a step: finalizing the interpreter around it
        # can abort the process (a C++ thread destroyed while running), so leave at once.
        logging.shutdown()
        os._exit(server.exit_code)
    return 0
