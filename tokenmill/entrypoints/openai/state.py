"""`ServerState`: what one server process holds (the engine, its metrics and stats stream, the
serving layer once the model has loaded, whether it is draining), and the checks a request
passes against it before it reaches the engine: the API key (401), loading, failed or shutting
down (503), too many requests queued (429)."""

from __future__ import annotations

import hmac
import time

from fastapi import Request

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.args import ServerConfig
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import check_request
from tokenmill.entrypoints.openai.serving import APIError, OpenAIServing
from tokenmill.entrypoints.openai.stats_stream import StatsStream
from tokenmill.entrypoints.openai.templates import read_template
from tokenmill.entrypoints.openai.tool_calls import tools_in_template


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
        self.serving: OpenAIServing | None = None  # set once the model has loaded
        self.draining = False
        self.started = time.time()

    def admit(self, request: Request, body, model: bool = False) -> OpenAIServing:
        """The serving layer for a request on the model, past the guards every such endpoint
        shares: the API key (401), the body's fields (400), the server's state (503), and with
        `model` the model it names (404)."""
        self.check_auth(request)
        check_request(body)
        serving = self.ready_serving()
        if model:
            serving.check_model(body.model)
        return serving

    def ready_serving(self) -> OpenAIServing:
        """The serving layer; a 503 `APIError` while draining, while the model loads (with
        Retry-After) or after it failed to load."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error")
        if self.serving is None:
            if self.llm.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.llm.load_error}", type="server_error")
            raise APIError(503, "the model is still loading", type="server_error", headers={"Retry-After": "5"})
        return self.serving

    def check_auth(self, request: Request) -> None:
        """A 401 `APIError` unless the request carries `Authorization: Bearer <--api-key>` (when one is set)."""
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           type="authentication_error", code="invalid_api_key")

    def check_capacity(self) -> None:
        """A 429 `APIError` (with Retry-After) when --max-waiting-requests are queued already."""
        waiting = self.llm.num_unfinished - self.llm.stats.num_running
        if waiting >= self.config.max_waiting_requests:
            raise APIError(429, f"too many requests queued ({waiting}); retry shortly",
                           type="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
