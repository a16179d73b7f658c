#!/usr/bin/env python
"""One model split over ranks, and replicas, against one process, side by side in one run: the
same load on `tokenmill serve` as one process with all the threads, with
`--tensor-parallel-size N`, `--pipeline-parallel-size N` and `--data-parallel-size N` (each
sharing the same threads between its N processes).

Workloads (greedy, EOS ignored, prompts cut from GPL-3 text with the GGUF's tokenizer, so every
server gets identical requests):
- single: one request at a time (`--single-requests`): the latency a split adds to each step;
- short: `--concurrency` requests in flight in a closed loop (`--num-requests`), random prompts of
  16:64 tokens, 128 output tokens: throughput under load.

Reported per workload and server: output tok/s, TTFT p50/p99, ITL p50 (the client's clock), and
each as a ratio to the one-process server.

    python benchmarks/parallel.py
    python benchmarks/parallel.py --num-requests 4 --single-requests 2 --output-len 8 --num-warmups 0   # smoke test
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import data_parallel
from common import RESULTS_DIR, device_name, fmt, print_table, write_report
from data_parallel import run_server

DEFAULT_OUTPUT = RESULTS_DIR / "parallel.json"
WORKLOADS = {"single": data_parallel.WORKLOADS["short"], "short": data_parallel.WORKLOADS["short"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig, num_physical_cores

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=EngineConfig().model, help="model alias or .gguf file")
    p.add_argument("--num-threads", type=int, default=num_physical_cores(), help="CPU threads of each server in all")
    p.add_argument("--size", type=int, default=2, help="N: ranks of the split servers, replicas of the data-parallel one")
    p.add_argument("--setups", default="one,tp,pp,dp", help="comma-separated subset of one,tp,pp,dp")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in the short workload")
    p.add_argument("--num-requests", type=int, default=64, help="measured requests of the short workload")
    p.add_argument("--single-requests", type=int, default=8, help="measured requests of the single workload")
    p.add_argument("--output-len", default=None, metavar="N|MIN:MAX", help="override the output length (smoke tests)")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent and discarded before each measured run")
    p.add_argument("--server-args", default="--dtype float32",
                   help="extra flags for every server, one string written with '=' (--server-args=\"--dtype bfloat16\")")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server's /health")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (the servers' logs go next to it)")
    args = p.parse_args(argv)
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if "one" not in args.setups or any(s not in ("one", "tp", "pp", "dp") for s in args.setups):
        p.error("--setups: a subset of one,tp,pp,dp that includes one (the baseline)")
    return args


def bench_config(args, workload: str, base_url: str, label: str, tokenizer_path: Path):
    """data_parallel.py's `short` workload; `single` is the same one request at a time."""
    single = workload == "single"
    shaped = argparse.Namespace(**{**vars(args), "concurrency": 1 if single else args.concurrency,
                                   "num_requests": args.single_requests if single else args.num_requests})
    return data_parallel.bench_config(shaped, "short", base_url, label, tokenizer_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds through the servers' `finally`
    from tokenmill.bench.benchmark import prepare_requests
    from tokenmill.models.registry import resolve_model

    model_path = resolve_model(args.model)
    if model_path.suffix != ".gguf":
        raise SystemExit(f"this benchmark cuts prompts with the GGUF file's tokenizer; got {model_path}")
    workloads = {name: prepare_requests(bench_config(args, name, "http://localhost", "-", model_path)) for name in WORKLOADS}
    n, t = str(args.size), ["--num-threads", str(args.num_threads)]
    flags = {"one": t, "tp": ["--tensor-parallel-size", n, *t], "pp": ["--pipeline-parallel-size", n, *t],
             "dp": ["--data-parallel-size", n, *t]}
    labels = {"one": "one process", "tp": f"TP={n}", "pp": f"PP={n}", "dp": f"DP={n}"}
    print(f"model {model_path.name}, {args.num_threads} threads per server; {device_name('cpu')}", flush=True)
    args.server_args = f"{args.server_args} --log-stats-interval 0"
    results = []
    for setup in args.setups:
        results += run_server(args, labels[setup], flags[setup], workloads, model_path, bench_config)

    base = {r["workload"]: r["summary"] for r in results if r["setup"] == labels["one"]}
    header = ["workload", "server", "ok", "output tok/s", "x one", "TTFT p50", "TTFT p99", "ITL p50", "ITL x one"]
    rows = []
    for r in sorted(results, key=lambda r: list(WORKLOADS).index(r["workload"])):
        s, b = r["summary"], base[r["workload"]]
        rows.append([r["workload"], r["setup"], f"{s['completed']}/{s['num_sent']}", fmt(s["output_throughput"]),
                     f"{s['output_throughput'] / b['output_throughput']:.2f}", fmt(s["ttft_ms"]["p50"]),
                     fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]), f"{s['itl_ms']['p50'] / b['itl_ms']['p50']:.2f}"])
    print()
    print_table(header, rows, left=2)
    print()
    print(f"latencies in ms on the client's clock; single: 1 in flight, short: {args.concurrency} in flight; "
          f"server flags {args.server_args!r}; host {device_name('cpu')}")
    write_report(args.output, "parallel",
                 config={"model": args.model, "model_file": str(model_path), "servers": {labels[s]: flags[s] for s in args.setups},
                         "workloads": WORKLOADS, "output_len_override": args.output_len, "concurrency": args.concurrency,
                         "num_requests": args.num_requests, "single_requests": args.single_requests,
                         "num_warmups": args.num_warmups, "server_args": args.server_args, "seed": args.seed,
                         "greedy": True, "ignore_eos": True},
                 results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
