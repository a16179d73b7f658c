"""`tokenmill bench sweep`: the same workload at a list of concurrencies or request rates.

The workload is built once (same prompts and lengths at every load), each load is one
`bench serve` run, and the runs are saved together and drawn as a latency-throughput frontier.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from tokenmill.bench.benchmark import (
    SWEEP_KIND, BenchConfig, BenchError, discover_server, prepare_requests, run_benchmark,
)

__all__ = ["LOAD_KINDS", "SWEEP_KIND", "main_sweep", "parse_loads", "run_sweep"]

LOAD_KINDS = ("concurrency", "request_rate")


def parse_loads(text: str, load_kind: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{load_kind}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise BenchError(f"{load_kind}: every value must be > 0, got {text!r}")
    if load_kind == "concurrency" and any(v != int(v) for v in values):
        raise BenchError(f"concurrency: values must be whole numbers, got {text!r}")
    return values


def run_sweep(config: BenchConfig, load_kind: str, values: list[float], on_run=None) -> dict:
    if load_kind not in LOAD_KINDS:
        raise BenchError(f"load_kind: must be one of {LOAD_KINDS}, got {load_kind!r}")
    server = discover_server(config)
    requests = prepare_requests(config)
    runs = []
    for value in values:
        change = {"concurrency": int(value)} if load_kind == "concurrency" else {"request_rate": value}
        run = run_benchmark(dataclasses.replace(config, output=None, **change), requests, server, load_kind)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    met = [r["load_value"] for r in runs if r["summary"]["slo"]["met"]]
    return {
        "kind": SWEEP_KIND,
        "format_version": 1,
        "label": runs[0]["label"],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_kind": load_kind,
        "loads": values,
        "config": runs[0]["config"] | {load_kind: None},
        "best_load_meeting_slos": max(met) if met else None,
        "runs": runs,
    }


def main_sweep(args) -> int:
    from tokenmill.bench.plot import plot_results
    from tokenmill.bench.report import format_run, format_sweep, write_json

    load_kind = "concurrency" if args.concurrencies else "request_rate"
    values = parse_loads(args.concurrencies or args.request_rates, load_kind)
    config = BenchConfig.from_args(args)
    sweep = run_sweep(config, load_kind, values, on_run=lambda run: print(format_run(run), flush=True))
    print(format_sweep(sweep))
    if config.output:
        print(f"results: {write_json(config.output, sweep)}")
    if args.plot:
        print(f"plot: {plot_results([sweep], args.plot, title=args.title)}")
    return 0 if any(r["summary"]["completed"] for r in sweep["runs"]) else 1
