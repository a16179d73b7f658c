"""The server's own settings and their command-line flags (kept free of heavy imports so
`tokenmill --help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model argument
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 8 * 2**20
    shutdown_timeout: float = 30.0
    # The engine is declared dead (every request failed, /health 503, exit status 1) when one
    # step runs longer than this many seconds; 0 = never.
    engine_step_timeout: float = 60.0
    log_stats_interval: float = 10.0
    chat_template: str | None = None  # a Jinja file used instead of the model's chat template


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"port to listen on (default: {d.port})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and /v1/models lists (default: the model argument)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on the API endpoints (/health, /metrics, /version stay open)")
    parser.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                        help=f"answer 429 while this many requests are queued (default: {d.max_waiting_requests})")
    parser.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                        help=f"answer 413 for larger request bodies (default: {d.max_request_body_bytes})")
    parser.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                        help=f"seconds running requests get to finish on SIGTERM (default: {d.shutdown_timeout:g})")
    parser.add_argument("--engine-step-timeout", type=float, default=d.engine_step_timeout,
                        help="seconds one engine step may run before the engine counts as wedged: every request "
                             "then gets an error, /health answers 503 and the server exits with status 1; 0 = no "
                             f"limit (default: {d.engine_step_timeout:g})")
    parser.add_argument("--log-stats-interval", type=float, default=d.log_stats_interval,
                        help=f"seconds between engine stats log lines, 0 = off (default: {d.log_stats_interval:g})")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file to use instead of the model's own (e.g. one that supports tools)")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                        max_request_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout,
                        log_stats_interval=args.log_stats_interval, chat_template=args.chat_template,
                        engine_step_timeout=args.engine_step_timeout)
