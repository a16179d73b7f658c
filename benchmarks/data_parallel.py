#!/usr/bin/env python
"""Data parallelism on one machine: `tokenmill serve` as 1 replica with all the threads against
`--data-parallel-size N` replicas sharing them, one after the other in one run, under the same
load from `tokenmill bench serve`'s load generator.

Servers (each started here on a free port, waited for, measured on every workload, stopped):
- `1x{T}`: `tokenmill serve --num-threads T`;
- `{N}x{T/N}`: `tokenmill serve --data-parallel-size N --num-threads T` (the front end routes each
  request to the replica holding the longest cached prefix of its prompt, else the least loaded).
T is `--num-threads` (default: the physical cores). Both get `--server-args`.

Workloads (`--workloads`, default both; greedy, EOS ignored, `--concurrency` requests in flight in
a closed loop, `--num-requests` each, prompts cut from GPL-3 text with the GGUF's tokenizer, so
both servers get identical requests):
- short: random prompts of 16:64 tokens, 128 output tokens;
- shared-prefix: chat requests under 4 system prompts of 512 tokens (a 32-token question each),
  64 output tokens: what the router's prefix affinity is for.

Reported per workload and server: output tok/s, TTFT p50/p99, ITL p50 (the client's clock), and
the prefix-cache hit rate over all replicas (tokens found / tokens looked up, from /metrics).

    python benchmarks/data_parallel.py
    python benchmarks/data_parallel.py --num-requests 4 --concurrency 2 --output-len 8 --num-warmups 0   # smoke test
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from common import RESULTS_DIR, device_name, fmt, print_table, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = RESULTS_DIR / "data_parallel.json"
WORKLOADS = {
    "short": {"dataset": "random", "input_len": "16:64", "output_len": "128"},
    "shared-prefix": {"dataset": "shared-prefix", "num_groups": 4, "system_prompt_len": 512, "question_len": "32",
                      "output_len": "64"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig, num_physical_cores

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=EngineConfig().model, help="model alias or .gguf file")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--num-threads", type=int, default=num_physical_cores(),
                   help="CPU threads of each server in all (split between the replicas)")
    p.add_argument("--data-parallel-size", type=int, default=2, help="replicas of the data-parallel server")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (closed loop)")
    p.add_argument("--num-requests", type=int, default=64, help="measured requests per workload and server")
    p.add_argument("--output-len", default=None, metavar="N|MIN:MAX",
                   help="override every workload's output length (smoke tests); default: the workload's")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent and discarded before each measured run")
    p.add_argument("--server-args", default="",
                   help="extra flags for both servers, one string written with '=' "
                        "(--server-args=\"--kv-cache-memory-gb 0.5\")")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server's /health")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (the servers' logs go next to it)")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if not args.workloads or bad:
        p.error(f"--workloads: expected a comma-separated subset of {','.join(WORKLOADS)}, got {bad or 'nothing'}")
    for name in ("num_threads", "concurrency", "num_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.data_parallel_size < 2:
        p.error("--data-parallel-size must be >= 2 (the other server is the single replica)")
    return args


def bench_config(args, workload: str, base_url: str, label: str, tokenizer_path: Path):
    from tokenmill.bench.benchmark import BenchConfig

    w = dict(WORKLOADS[workload])
    if args.output_len:
        w["output_len"] = args.output_len
    return BenchConfig(base_url=base_url, label=label, num_requests=args.num_requests, ignore_eos=True,
                       tokenizer=str(tokenizer_path), seed=args.seed, concurrency=args.concurrency,
                       num_warmups=args.num_warmups, percentiles="50,90,99", progress=False, **w)


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """(tokens found in the prefix cache, tokens looked up), summed over a server's replicas."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import scrape_metrics

    metrics = scrape_metrics(url)
    total = lambda name: sum(v for k, v in metrics.items() if k.split("{")[0] == name)  # noqa: E731
    return total("tokenmill_prefix_cache_hits_total"), total("tokenmill_prefix_cache_queries_total")


def run_server(args, label: str, flags: list[str], workloads: dict, tokenizer_path: Path,
               config_for=bench_config) -> list[dict]:
    """Start a server with `flags`, run each workload against it (`config_for(args, workload,
    url, label, tokenizer_path)`: its BenchConfig), stop it; the runs' results."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import ServerProcess
    from tokenmill.bench.benchmark import run_benchmark

    log_path = args.output.with_suffix(f".{label}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, *flags, *shlex.split(args.server_args), log_path=log_path)
    runs = []
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.server_timeout)
        print(f"{label}: ready in {time.perf_counter() - t0:.1f}s (log {log_path})", flush=True)
        for name, requests in workloads.items():
            print(f"{label}: workload {name} ...", flush=True)
            hits0, queries0 = prefix_cache_totals(server.url)
            result = run_benchmark(config_for(args, name, server.url, label, tokenizer_path), requests=requests)
            hits1, queries1 = prefix_cache_totals(server.url)
            hit_rate = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else None
            runs.append({"setup": label, "workload": name, "server_flags": flags, "prefix_cache_hit_rate": hit_rate,
                         **result})
    finally:
        exit_code = server.stop()
        if exit_code:
            print(f"{label}: exited with status {exit_code} (log {log_path})", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM to this script unwinds through the `finally` that stops the server
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from tokenmill.bench.benchmark import prepare_requests
    from tokenmill.models.registry import resolve_model

    model_path = resolve_model(args.model)
    if model_path.suffix != ".gguf":
        raise SystemExit(f"this benchmark cuts prompts with the GGUF file's tokenizer; got {model_path}")
    workloads = {name: prepare_requests(bench_config(args, name, "http://localhost", "-", model_path))
                 for name in args.workloads}
    n, t = args.data_parallel_size, args.num_threads
    servers = {f"1x{t}": ["--num-threads", str(t)],
               f"{n}x{max(1, t // n)}": ["--data-parallel-size", str(n), "--num-threads", str(t)]}
    print(f"model {model_path.name}; {args.num_requests} requests per workload, concurrency {args.concurrency}; "
          f"{device_name('cpu')}", flush=True)

    results = []
    for label, flags in servers.items():
        results += run_server(args, label, flags, workloads, model_path)

    print()
    header = ["workload", "replicas x threads", "ok", "output tok/s", "TTFT p50", "TTFT p99", "ITL p50", "prefix hits"]
    rows = []
    for r in sorted(results, key=lambda r: args.workloads.index(r["workload"])):  # stable: servers in run order
        s = r["summary"]
        hits = "-" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.0f}%"
        rows.append([r["workload"], r["setup"], f"{s['completed']}/{s['num_sent']}", fmt(s["output_throughput"]),
                     fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]), hits])
    print_table(header, rows, left=2)
    print()
    print(f"latencies in ms on the client's clock; {args.concurrency} in flight, {args.num_requests} requests; "
          f"host {device_name('cpu')}")
    write_report(args.output, "data_parallel",
                 config={"model": args.model, "model_file": str(model_path), "servers": servers,
                         "workloads": {name: WORKLOADS[name] for name in args.workloads},
                         "output_len_override": args.output_len, "concurrency": args.concurrency,
                         "num_requests": args.num_requests, "num_warmups": args.num_warmups,
                         "server_args": args.server_args, "seed": args.seed, "greedy": True, "ignore_eos": True},
                 results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
