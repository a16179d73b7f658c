"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

One process: uvicorn's event loop answers HTTP, an `AsyncLLM` steps the engine on its own
thread. The model loads in the background after the socket is open (`/health` answers 503
until it is ready). SIGTERM/SIGINT drain: new requests get 503, running ones get up to
`--shutdown-timeout` seconds to finish, the rest are aborted, and the process exits 0. When the
engine dies (a step raised, or ran past `--engine-step-timeout`), every request gets an error,
/health answers 503, and the process exits with status 1 `DEAD_EXIT_GRACE` seconds later, for a
supervisor to restart it.

`build_app` puts the app together from its parts: the process's `ServerState` (state.py), the
request size limits (here), the error handlers and OpenAPI schema (errors.py), the endpoints
(routes.py) and the web page (entrypoints/web/).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from contextlib import asynccontextmanager

import h11
import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.args import PROMPT_CHARS_PER_TOKEN, ServerConfig
from tokenmill.entrypoints.openai.errors import add_error_handlers, openapi_schema
from tokenmill.entrypoints.openai.routes import add_generation_routes, add_model_routes, add_operations_routes
from tokenmill.entrypoints.openai.serving import OpenAIServing
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.web import web_routes
from tokenmill.version import __version__

logger = logging.getLogger(__name__)


def build_app(engine_config: EngineConfig, config: ServerConfig) -> FastAPI:
    state = ServerState(engine_config, config)
    app = FastAPI(title="tokenmill", version=__version__, lifespan=_lifespan)
    app.state.server = state
    add_request_limits(app, config)
    app.openapi = lambda: openapi_schema(app)
    add_error_handlers(app)
    add_generation_routes(app, state)
    add_model_routes(app, state)
    add_operations_routes(app, state)
    if config.web_ui:
        app.router.routes.extend(web_routes())
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine thread runs while the app does; the model loads meanwhile (`_when_ready`)."""
    state: ServerState = app.state.server
    state.llm.start()
    asyncio.ensure_future(_when_ready(state))
    yield
    state.llm.shutdown()


async def _when_ready(state: ServerState) -> None:
    """Once the model has loaded, the serving layer that the endpoints wait for (503 until then)."""
    try:
        engine = await state.llm.wait_ready()
    except BaseException:  # noqa: BLE001 - logged by the engine thread; /health stays 503
        return
    config = state.config
    max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_model_len
    state.serving = OpenAIServing(state.llm, engine, state.model_name, state.metrics, state.chat_template,
                                  max_prompt_chars=max_prompt_chars)
    logger.info("serving %s on http://%s:%d", state.model_name, config.host, config.port)


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
