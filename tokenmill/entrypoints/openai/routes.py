"""The server's endpoints, in the groups `build_app` adds: generation (`/v1/completions`,
`/v1/chat/completions`: JSON, or server-sent events when streamed), the model and its tokenizer
(`/v1/models`, `/tokenize`, `/detokenize`) and operations (`/health`, `/version`, `/metrics`,
`/stats/stream`). Each endpoint passes the `ServerState` checks it needs before it touches the
engine. The endpoints' function names are part of the OpenAPI schema (operation ids)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill.entrypoints.openai.errors import error_response
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.serving import APIError, ClientDisconnected, OpenAIServing
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.stats_stream import DEFAULT_INTERVAL, MAX_INTERVAL, MIN_INTERVAL
from tokenmill.version import __version__


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, OpenAIServing.completions, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, OpenAIServing.chat_completions, body)


async def _generate(state: ServerState, request: Request, handler, body):
    """Run `handler(serving, body, is_disconnected)` behind the guards: a JSON answer, or SSE."""
    s = state.admit(request, body)
    state.check_capacity()
    try:
        result = await handler(s, body, lambda: _disconnected(request))
    except ClientDisconnected:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "tokenmill",
            "max_model_len": state.serving.engine.max_model_len if state.serving else None,
        }]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        s = state.admit(request, body, model=True)
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
        s = state.admit(request, body, model=True)
        vocab = s.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": s.engine.tokenizer.decode(body.tokens)}


def add_operations_routes(app: FastAPI, state: ServerState) -> None:
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
        state.check_auth(request)
        if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
            raise APIError(400, f"interval must be in [{MIN_INTERVAL:g}, {MAX_INTERVAL:g}] seconds, got {interval:g}",
                           param="interval")
        events = state.stats_stream.events(interval, lambda: state.draining or state.llm.dead_error is not None)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
