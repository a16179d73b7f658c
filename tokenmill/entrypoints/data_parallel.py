"""`tokenmill serve --data-parallel-size N` (N > 1): one HTTP front end in front of N engine
replicas (`replicas.py`), each a whole tokenmill server on 127.0.0.1.

The front end tokenizes each completion or chat prompt as the server does (the chat template
rendered by `ChatTemplate`), hashes its full blocks and asks the `Router` for a replica: the one
holding the longest cached prefix, else the least loaded. Everything else the server answers
(/v1/models, /tokenize, /version, /openapi.json, ...) goes by load. Requests and responses pass
through unchanged, streams chunk by chunk; a client that goes away closes the upstream
connection, and the replica aborts the request. `/health` is the front end's own (200 once every
replica is healthy); `/metrics` is every replica's samples labelled `replica="i"` plus the
router's counters. The web page (`/`, `/web/*`) is the front end's own; the stats stream its
engine view reads (`/stats/stream`) is replica 0's, passed through outside the router's counts
with a header `X-Tokenmill-Replica: 0 of N`.

A replica that exits while the front end is serving ends the front end with status 1 (after it
stops the others): it never goes on with fewer replicas. SIGTERM/SIGINT drain: new requests get
503, the replicas get SIGTERM and finish their running requests (`--shutdown-timeout`), then
the front end exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette import routing
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.api_server import add_request_limits, uvicorn_config
from tokenmill.entrypoints.openai.args import PROMPT_CHARS_PER_TOKEN, ServerConfig
from tokenmill.entrypoints.openai.chat import ChatTemplate
from tokenmill.entrypoints.openai.errors import error_response
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.tool_calls import check_tools
from tokenmill.entrypoints.replicas import ReplicaSet, exit_description
from tokenmill.entrypoints.router import Route, Router, prompt_block_hashes
from tokenmill.entrypoints.web import web_routes

logger = logging.getLogger(__name__)

SCRAPE_INTERVAL = 1.0  # seconds between reads of each replica's KV-cache usage
REPLICA_STOP_TIMEOUT = 10.0  # seconds a replica gets to stop after SIGTERM once the front end is exiting
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
# Headers that describe one connection, not the message, and those the other side sets anew.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade"}
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length"}
_NOT_RETURNED = _HOP_BY_HOP | {"date", "server"}


class ReplicaError(RuntimeError):
    """A replica that will never serve."""


class FrontEnd:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig, replicas: ReplicaSet):
        self.engine_config = engine_config
        self.config = config
        self.replicas = replicas
        self.model_name = config.served_model_name or engine_config.model
        n = len(replicas.replicas)
        self.clients = [httpx.AsyncClient(base_url=r.url, timeout=httpx.Timeout(None, connect=10.0),
                                          limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
                        for r in replicas.replicas]
        self.router: Router | None = None  # once every replica is healthy
        self.chat_template: ChatTemplate | None = None
        self.max_prompt_chars = config.max_prompt_chars
        self.num_healthy = 0
        self.bring_up_task: asyncio.Task | None = None  # then reads KV-cache usage until the end
        self.draining = False
        # The tokenizer is used by one thread at a time, off the event loop.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")
        self.registry = CollectorRegistry()
        self.routed = Counter("tokenmill_router_requests_routed", "Requests the front end sent to each replica, by "
                              "why: prefix (it held the longest cached prefix) or load (the least loaded)",
                              ["replica", "reason"], registry=self.registry)
        self.in_flight = Gauge("tokenmill_router_requests_in_flight", "Requests sent to each replica whose "
                               "response has not ended", ["replica"], registry=self.registry)
        for i in range(n):
            for reason in ("prefix", "load"):
                self.routed.labels(str(i), reason)
            self.in_flight.labels(str(i))

    # -- start-up -----------------------------------------------------------------------------------

    async def bring_up(self) -> None:
        """Load the tokenizer while every replica starts, learn what routing needs from replica
        0, then read the replicas' KV-cache usage until the end. Raises when one cannot serve."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(loop.run_in_executor(self.tokenize_pool, self._load_chat_template),
                             *(self._wait_healthy(i) for i in range(len(self.clients))))
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        max_model_len = (await self.clients[0].get("/v1/models", headers=headers)).json()["data"][0]["max_model_len"]
        self.max_prompt_chars = self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len
        self.router = Router(len(self.clients), prefix_cache_blocks((await self.clients[0].get("/metrics")).text))
        logger.info("serving %s on http://%s:%d: %d replicas x %d CPU threads, routed by cached prefix and load",
                    self.model_name, self.config.host, self.config.port, len(self.clients), self.replicas.num_threads)
        while True:
            await self._read_kv_cache_usage()
            await asyncio.sleep(SCRAPE_INTERVAL)

    async def _wait_healthy(self, index: int) -> None:
        replica = self.replicas.replicas[index]
        while (health := await _health(self.clients[index])) != "ok":
            if health.startswith("load failed"):  # it would answer 503 for ever
                raise ReplicaError(f"{replica}: {health}")
            await asyncio.sleep(0.2)
        self.num_healthy += 1
        logger.info("%s is ready", replica)

    def _load_chat_template(self) -> None:
        from tokenmill.models.loader import load_checkpoint
        from tokenmill.models.registry import resolve_model

        path = resolve_model(self.engine_config.model)
        template = Path(self.config.chat_template).read_text() if self.config.chat_template else None
        self.chat_template = ChatTemplate(load_checkpoint(path).tokenizer, template, path.name)

    async def _read_kv_cache_usage(self) -> None:
        for i, client in enumerate(self.clients):
            try:
                usage = _sample_value((await client.get("/metrics", timeout=5.0)).text, "tokenmill_kv_cache_usage_perc")
            except httpx.HTTPError:
                continue  # a replica that stopped is noticed by its exit
            if usage is not None:
                self.router.kv_cache_usage[i] = usage

    # -- routing ------------------------------------------------------------------------------------

    def prompt_token_ids(self, path: str, body: bytes) -> list[int]:
        """The prompt's token ids as the replica will see them (the first prompt of a list);
        [] when the request has none or the replica will refuse it (it answers the error)."""
        tokenizer = self.chat_template.tokenizer
        try:
            if path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate_json(body)
                text = self.chat_template.render(req.messages, check_tools(req.tools, req.tool_choice))
                add_special_tokens = False  # the chat template placed them
            else:
                prompt = CompletionRequest.model_validate_json(body).prompt
                while isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                if not isinstance(prompt, str):
                    return list(prompt)
                text, add_special_tokens = prompt, True
        except Exception:  # noqa: BLE001 - any request the replica will refuse (it says why)
            return []
        if len(text) > self.max_prompt_chars:
            return []
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def route(self, request: Request, body: bytes) -> Route:
        hashes = []
        if request.method == "POST" and request.url.path in ("/v1/completions", "/v1/chat/completions"):
            token_ids = await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, self.prompt_token_ids, request.url.path, body)
            hashes = prompt_block_hashes(token_ids, self.engine_config.block_size)
        route = self.router.choose(hashes)
        self.routed.labels(str(route.replica), route.reason).inc()
        self.in_flight.labels(str(route.replica)).inc()
        return route

    def finish(self, replica: int) -> None:
        self.router.finish(replica)
        self.in_flight.labels(str(replica)).dec()

    # -- metrics ------------------------------------------------------------------------------------

    async def metrics_text(self) -> bytes:
        """Every replica's samples with a `replica` label, then the router's."""
        texts = await asyncio.gather(*(c.get("/metrics", timeout=10.0) for c in self.clients), return_exceptions=True)
        families: dict[str, Metric] = {}
        for i, response in enumerate(texts):
            if isinstance(response, BaseException):
                logger.warning("/metrics: replica %d did not answer (%r)", i, response)
                continue
            for family in text_string_to_metric_families(response.text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": str(i)}, s.value, s.timestamp, s.exemplar)
        replicas = CollectorRegistry()
        replicas.register(_Families(list(families.values())))
        return generate_latest(replicas) + generate_latest(self.registry)


class _Families:
    """A prometheus-client collector of metric families already gathered."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


class _Proxied:
    """An ASGI response: the replica's response to one request, passed on as it arrives. The
    client's disconnect (before or during the response) cancels it, which closes the upstream
    connection (the replica then aborts the request). A `routed` request is one the router
    chose the replica for: it is counted out of the router's in-flight count when it ends."""

    def __init__(self, front: FrontEnd, replica: int, request: Request, body: bytes, routed: bool = True,
                 extra_headers: list[tuple[bytes, bytes]] = ()):
        self.front, self.replica, self.request, self.body = front, replica, request, body
        self.routed = routed
        self.extra_headers = list(extra_headers)

    async def __call__(self, scope, receive, send) -> None:
        forward = asyncio.ensure_future(self._forward(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forward.cancel()
            gone.cancel()
            await asyncio.gather(forward, gone, return_exceptions=True)
            if self.routed:
                self.front.finish(self.replica)
        if not forward.cancelled():
            forward.result()  # an error while streaming: uvicorn closes the connection

    async def _forward(self, send) -> None:
        request = self.request
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _NOT_FORWARDED]
        url = httpx.URL(path=request.url.path, query=request.url.query.encode() or None)
        client = self.front.clients[self.replica]
        try:
            upstream_request = client.build_request(request.method, url, headers=headers, content=self.body)
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError as e:
            logger.error("replica %d: %s %s failed: %r", self.replica, request.method, request.url.path, e)
            await error_response(502, f"replica {self.replica} did not answer: {e!r}", type="server_error")(
                request.scope, request.receive, send)
            return
        try:
            headers = [(k, v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in _NOT_RETURNED]
            headers += self.extra_headers
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await upstream.aclose()


def build_front_end(engine_config: EngineConfig, config: ServerConfig, replicas: ReplicaSet) -> Starlette:
    front = FrontEnd(engine_config, config, replicas)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        front.bring_up_task = asyncio.ensure_future(front.bring_up())
        yield
        front.bring_up_task.cancel()
        front.tokenize_pool.shutdown(wait=False)
        for client in front.clients:
            await client.aclose()

    async def health(request: Request) -> Response:
        if front.draining:
            return error_response(503, "shutting down", type="server_error")
        if front.router is None:
            return error_response(503, f"starting: {front.num_healthy} of {len(front.clients)} replicas ready",
                                  type="server_error")
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(await front.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    def unavailable() -> Response | None:
        if front.draining:
            return error_response(503, "the server is shutting down", type="server_error")
        if front.router is None:
            return error_response(503, "the model is still loading", type="server_error", headers={"Retry-After": "5"})
        return None

    async def proxy(request: Request) -> Response | _Proxied:
        if (refused := unavailable()) is not None:
            return refused
        body = await request.body()
        route = await front.route(request, body)
        return _Proxied(front, route.replica, request, body)

    async def stats_stream(request: Request) -> Response | _Proxied:
        """Replica 0's stream: a long-lived connection that must not count as load."""
        if (refused := unavailable()) is not None:
            return refused
        replica = f"0 of {len(front.clients)}".encode()
        return _Proxied(front, 0, request, b"", routed=False, extra_headers=[(b"x-tokenmill-replica", replica)])

    routes = [routing.Route("/health", health, methods=["GET"]), routing.Route("/metrics", metrics, methods=["GET"]),
              routing.Route("/stats/stream", stats_stream, methods=["GET"])]
    if config.web_ui:
        routes += web_routes()
    app = Starlette(routes=[*routes, routing.Route("/{path:path}", proxy, methods=_METHODS)], lifespan=lifespan)
    app.state.front = front
    add_request_limits(app, config)
    return app


class _FrontEndServer(uvicorn.Server):
    """Exits with status 1 as soon as a replica exits on its own; drains on the first
    SIGTERM/SIGINT (the replicas drain themselves), stops at once on the second."""

    def __init__(self, config: uvicorn.Config, front: FrontEnd):
        super().__init__(config)
        self.front = front
        self.exit_code = 0
        self.drain_deadline = float("inf")

    async def on_tick(self, counter: int) -> bool:
        replicas = self.front.replicas
        task = self.front.bring_up_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            e = task.exception()
            logger.error("%s; stopping the replicas and exiting with status 1",
                         e if isinstance(e, ReplicaError) else f"the front end failed: {e!r}")
            self.exit_code = 1
            return True
        if self.front.draining:
            if replicas.all_exited() or time.monotonic() > self.drain_deadline:  # past it, `stop` kills them
                self.exit_code = int(any(r.process.exitcode != 0 for r in replicas.replicas))
                return True
        elif (replica := replicas.first_exited()) is not None:
            logger.error("%s %s; stopping the other replicas and exiting with status 1", replica,
                         exit_description(replica.process.exitcode))
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if self.front.draining or self.should_exit:  # a second signal: stop now
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        logger.info("shutting down: no new requests; the replicas finish their running requests")
        self.front.draining = True
        self.drain_deadline = time.monotonic() + self.front.config.shutdown_timeout + REPLICA_STOP_TIMEOUT
        self.front.replicas.terminate()


def run_data_parallel(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info") -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    replicas = ReplicaSet(engine_config, config, log_level)
    replicas.start()
    try:
        app = build_front_end(engine_config, config, replicas)
        server = _FrontEndServer(uvicorn_config(app, config, log_level), app.state.front)
        server.run()
        return server.exit_code
    finally:
        started = time.monotonic()
        replicas.stop(REPLICA_STOP_TIMEOUT)
        logger.info("replicas stopped in %.1fs", time.monotonic() - started)


async def _health(client: httpx.AsyncClient) -> str:
    """"ok", or why not: a replica's /health message ("loading", "load failed: ...")."""
    try:
        response = await client.get("/health", timeout=5.0)
        return "ok" if response.status_code == 200 else response.json()["error"]["message"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return f"not answering ({e!r})"


async def _disconnected(receive) -> None:
    """Returns when the client closes the connection (the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def prefix_cache_blocks(metrics_text: str) -> int:
    """How many prefix blocks a replica can keep, from its `/metrics`: its KV blocks plus what
    its prefix cache's host and disk tiers hold (their capacity in bytes over the bytes of a
    block), at least 1. The router remembers that many of the blocks it sent the replica."""
    num_blocks = int(_sample_value(metrics_text, "tokenmill_kv_cache_blocks") or 0)
    capacity = {sample.labels.get("tier"): sample.value for family in text_string_to_metric_families(metrics_text)
                if family.name == "tokenmill_prefix_cache_tier_capacity_bytes" for sample in family.samples}
    device_bytes = capacity.get("device", 0.0)
    if not num_blocks or not device_bytes:
        return max(1, num_blocks)
    lower_bytes = capacity.get("host", 0.0) + capacity.get("disk", 0.0)
    return num_blocks + round(lower_bytes * num_blocks / device_bytes)


def _sample_value(metrics_text: str, name: str) -> float | None:
    """The value of the first sample of `name` in Prometheus text (enough for one-sample gauges)."""
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            return float(line.rsplit(" ", 1)[1])
    return None
