"""The server's own settings and their command-line flags (kept free of heavy imports so
`tokenmill --help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenmill.entrypoints.openai.templates import TOOLS_TEMPLATE, template_names, template_path

# The default --max-prompt-chars per token of context: far above any real text's characters per
# token, so a prompt it refuses would not have fit the context anyway; it keeps the tokenizer
# from spending seconds of the event loop on a body-sized prompt.
PROMPT_CHARS_PER_TOKEN = 16


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model argument
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 8 * 2**20
    max_header_bytes: int = 32 * 2**10  # the request line and headers together
    max_header_count: int = 100
    max_prompt_chars: int | None = None  # default: PROMPT_CHARS_PER_TOKEN x the model's context length
    shutdown_timeout: float = 30.0
    # The engine is declared dead (every request failed, /health 503, exit status 1) when one
    # step runs longer than this many seconds; 0 = never.
    engine_step_timeout: float = 60.0
    log_stats_interval: float = 10.0
    # A Jinja file, or a shipped template's name (templates/), used instead of the model's chat template.
    chat_template: str | None = None
    # Engine replicas behind one front end that routes by cached prefix and load (data_parallel.py).
    data_parallel_size: int = 1
    web_ui: bool = True  # the web page at / (entrypoints/web/)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _chat_template(text: str) -> str:
    """A shipped template's name or a file, as the path of the file (checked here, so that a
    typo stops the command at once)."""
    path = template_path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text!r}, and not a shipped template ({', '.join(template_names())})")
    return str(path)


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
    parser.add_argument("--max-header-bytes", type=_positive_int, default=d.max_header_bytes,
                        help=f"answer 431 when the request line and headers together are larger (default: {d.max_header_bytes})")
    parser.add_argument("--max-header-count", type=_positive_int, default=d.max_header_count,
                        help=f"answer 431 for requests with more headers (default: {d.max_header_count})")
    parser.add_argument("--max-prompt-chars", type=_positive_int, default=None,
                        help="answer 400 for a prompt (or a rendered chat) of more characters, before tokenizing it "
                             f"(default: {PROMPT_CHARS_PER_TOKEN} x the model's context length)")
    parser.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                        help=f"seconds running requests get to finish on SIGTERM (default: {d.shutdown_timeout:g})")
    parser.add_argument("--engine-step-timeout", type=float, default=d.engine_step_timeout,
                        help="seconds one engine step may run before the engine counts as wedged: every request "
                             "then gets an error, /health answers 503 and the server exits with status 1; 0 = no "
                             f"limit (default: {d.engine_step_timeout:g})")
    parser.add_argument("--log-stats-interval", type=float, default=d.log_stats_interval,
                        help=f"seconds between engine stats log lines, 0 = off (default: {d.log_stats_interval:g})")
    parser.add_argument("--chat-template", type=_chat_template, default=None, metavar="NAME|FILE",
                        help="the chat template to use instead of the model's own: a shipped template's name (one "
                             f"of: {', '.join(template_names())}) or a Jinja file; {TOOLS_TEMPLATE} is Qwen2.5's "
                             "Hermes-style tool-calling template in ChatML. Without this flag, requests with tools on "
                             f"a model whose template ignores them are rendered with {TOOLS_TEMPLATE} where the "
                             "model's template renders conversations as it does (ChatML; logged at start), and "
                             "are a 400 elsewhere")
    parser.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=d.data_parallel_size,
                        help="engine replicas, each a whole server in its own process on 127.0.0.1 with "
                             "--num-threads / N CPU threads (a GPU each when N are visible), behind one front end on "
                             "--host/--port that sends each request to the replica holding the longest cached prefix "
                             "of its prompt, else to the least loaded; every other flag applies to each replica "
                             f"(default: {d.data_parallel_size})")
    parser.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                        help="do not serve the web page at / (a chat playground and a live view of the engine); "
                             "the stats stream it reads, /stats/stream, stays")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                        max_request_body_bytes=args.max_request_body_bytes, max_header_bytes=args.max_header_bytes,
                        max_header_count=args.max_header_count, max_prompt_chars=args.max_prompt_chars,
                        shutdown_timeout=args.shutdown_timeout,
                        log_stats_interval=args.log_stats_interval, chat_template=args.chat_template,
                        engine_step_timeout=args.engine_step_timeout, data_parallel_size=args.data_parallel_size,
                        web_ui=args.web_ui)
