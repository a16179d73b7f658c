#!/usr/bin/env python
"""What the web page's live stats stream costs the engine: the real `tokenmill serve` under
`--concurrency` streams (64 by default), driven by `tokenmill bench serve`'s client, with and
without a client reading `/stats/stream` (as the page's engine view does), rounds interleaved
(off, on, off, on, ...) so that the host's drift falls on both.

Reported per mode (the median over rounds): output tok/s, ITL p50 (about one decode step at full
batch), TTFT p50, and the slowdown with the stream on. Then the in-process costs that bound it
without the noise of a shared host: one event (`StatsStream.snapshot` + JSON, over a full step
log and a minute of 64 streams' latencies) in microseconds and as a share of one core at the
stream's rate; one step's record (the engine thread's only addition) against a step's time; one
latency observation (the last minute's window, kept whether or not a client is connected).

    python benchmarks/web_ui_overhead.py
    python benchmarks/web_ui_overhead.py --rounds 1 --num-requests 64 --output-len 32   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path

from common import RESULTS_DIR, OtherLoad, busy_warning, fmt, machine_info, print_table, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = RESULTS_DIR / "web_ui_overhead.json"
MODES = ("stats stream off", "stats stream on")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--server-args", default="", help="more flags for `tokenmill serve`")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--input-len", default="16:64")
    p.add_argument("--output-len", default="64")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode, interleaved")
    p.add_argument("--stats-interval", type=float, default=0.5, help="seconds between the stream's events (the page's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return p.parse_args(argv)


class StatsClient:
    """Reads /stats/stream on a thread, as the page does, until stopped."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url, interval
        self.num_events = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> "StatsClient":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(10)

    def _read(self) -> None:
        import httpx

        with httpx.stream("GET", f"{self.url}/stats/stream", params={"interval": self.interval}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    json.loads(line[5:])
                    self.num_events += 1
                if self.stopped.is_set():
                    return


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_mode(args, mode: str, url: str, requests, tokenizer_path: Path, server_pid: int) -> dict:
    """One run; `other_processes_cores`: the CPU other processes than this one and the server used meanwhile."""
    from tokenmill.bench.benchmark import BenchConfig, run_benchmark

    config = BenchConfig(base_url=url, label=mode, dataset="random", num_requests=args.num_requests,
                         input_len=args.input_len, output_len=args.output_len, ignore_eos=True,
                         tokenizer=str(tokenizer_path), seed=args.seed, concurrency=args.concurrency,
                         percentiles="50,90,99", progress=False)
    other, server_start, t0 = OtherLoad(), cpu_seconds(server_pid), time.perf_counter()
    if mode == MODES[0]:
        result = run_benchmark(config, requests=requests)
        events = 0
    else:
        with StatsClient(url, args.stats_interval) as client:
            result = run_benchmark(config, requests=requests)
        events = client.num_events
    server_cores = (cpu_seconds(server_pid) - server_start) / (time.perf_counter() - t0)
    s = result["summary"]
    if s["failed"]:
        raise RuntimeError(f"{mode}: {s['failed']} requests failed: {s['errors']}")
    return {"mode": mode, "stats_events": events, "output_tok_s": s["output_throughput"],
            "itl_p50_ms": s["itl_ms"]["p50"], "ttft_p50_ms": s["ttft_ms"]["p50"], "duration_s": s["duration_s"],
            "server_cores": server_cores, "other_processes_cores": max(0.0, other.cores() - server_cores)}


def in_process_costs(concurrency: int, interval: float) -> dict:
    """Microseconds of one event, one step record and one latency observation, on full windows."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_llm import NUM_RECENT_STEPS, AsyncLLM, StepRecord
    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    from tokenmill.entrypoints.openai.stats_stream import StatsStream

    llm = AsyncLLM(EngineConfig())  # not started: its stats and step log are filled by hand
    metrics = ServerMetrics(llm, "m")
    now = time.monotonic()
    for i in range(NUM_RECENT_STEPS):
        llm.recent_steps.append(StepRecord(i + 1, now - (NUM_RECENT_STEPS - i) * 0.04, 0.04, 8, concurrency))
    for second in range(60):  # a minute of `concurrency` streams at 25 tokens/s each
        t = now - 60 + second
        for _ in range(concurrency):
            metrics.recent_ttft.observe(0.5 + (second % 7) * 0.1, now=t)
        for j in range(25 * concurrency):
            metrics.recent_itl.observe(0.02 + (j % 50) * 0.001, now=t)
    stream = StatsStream(llm, metrics, "m")
    last_step = NUM_RECENT_STEPS - 12  # about one interval's steps are new in each event
    event = lambda: json.dumps(stream.snapshot(since_step=last_step), separators=(",", ":"))  # noqa: E731
    n = 2000
    event_us = min(timeit.repeat(event, number=n, repeat=3)) / n * 1e6

    log = llm.recent_steps
    record = lambda: log.append(StepRecord(1, time.monotonic(), 0.04, 8, concurrency))  # noqa: E731
    n = 200_000
    record_us = min(timeit.repeat(record, number=n, repeat=3)) / n * 1e6
    window = metrics.recent_itl
    observe = lambda: window.observe(0.025)  # noqa: E731
    observe_us = min(timeit.repeat(observe, number=n, repeat=3)) / n * 1e6
    return {"event_us": event_us, "event_bytes": len(event()), "event_core_share": event_us * 1e-6 / interval,
            "step_record_us": record_us, "latency_observe_us": observe_us}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import ServerProcess
    from tokenmill.bench.benchmark import BenchConfig, prepare_requests
    from tokenmill.models.registry import resolve_model

    model_path = resolve_model(args.model)
    requests = prepare_requests(BenchConfig(dataset="random", num_requests=args.num_requests, input_len=args.input_len,
                                            output_len=args.output_len, ignore_eos=True, tokenizer=str(model_path),
                                            seed=args.seed))
    machine = machine_info()
    print(f"{args.concurrency} streams, {args.num_requests} requests a run (prompts {args.input_len}, outputs "
          f"{args.output_len} tokens), {args.rounds} rounds; CPU ISA {machine['cpu_isa']}, {machine['cpu_model']}",
          flush=True)

    log_path = args.output.with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, "--log-stats-interval", "0", *shlex.split(args.server_args), log_path=log_path)
    runs = []
    try:
        server.wait_ready()
        pid = server.proc.pid
        run_mode(args, MODES[0], server.url, requests[: args.concurrency], model_path, pid)  # warm-up
        for round_index in range(args.rounds):
            for mode in MODES:
                run = {"round": round_index, **run_mode(args, mode, server.url, requests, model_path, pid)}
                print(f"round {round_index + 1}, {mode}: {run['output_tok_s']:.1f} output tok/s, ITL p50 "
                      f"{run['itl_p50_ms']:.1f} ms ({run['stats_events']} stats events; other processes "
                      f"{run['other_processes_cores']:.2f} cores)", flush=True)
                runs.append(run)
    finally:
        server_exit = server.stop()

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    keys = ("output_tok_s", "itl_p50_ms", "ttft_p50_ms")
    summary = {mode: {key: median(mode, key) for key in keys} for mode in MODES}
    off, on = summary[MODES[0]], summary[MODES[1]]
    slowdown = {"output_tok_s": 1 - on["output_tok_s"] / off["output_tok_s"],
                "itl_p50_ms": on["itl_p50_ms"] / off["itl_p50_ms"] - 1}
    costs = in_process_costs(args.concurrency, args.stats_interval)

    print()
    print_table(["mode", "output tok/s", "ITL p50 ms", "TTFT p50 ms"],
                [[mode, fmt(summary[mode]["output_tok_s"]), fmt(summary[mode]["itl_p50_ms"]),
                  fmt(summary[mode]["ttft_p50_ms"])] for mode in MODES])
    print(f"with the stream on: output tok/s {-100 * slowdown['output_tok_s']:+.2f}%, "
          f"ITL p50 {100 * slowdown['itl_p50_ms']:+.2f}% (medians of {args.rounds} interleaved rounds)")
    warning = busy_warning({f"round {r['round'] + 1}, {r['mode']}": r["other_processes_cores"] for r in runs})
    if warning:
        print(warning)
    print()
    print_table(["in-process cost", "value"], [
        ["one event (snapshot + JSON), us", fmt(costs["event_us"])],
        [f"  share of one core at one event per {args.stats_interval:g} s", f"{100 * costs['event_core_share']:.3f}%"],
        ["  event size, bytes", str(costs["event_bytes"])],
        ["one step's record (engine thread), us", fmt(costs["step_record_us"], ".2f")],
        ["one latency observation (event loop), us", fmt(costs["latency_observe_us"], ".2f")],
    ])
    print(f"host: {machine['cpu_model']}, CPU ISA {machine['cpu_isa']}, load average {machine.get('load_average')}")

    write_report(args.output, "web_ui_overhead",
                 config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 results={"runs": runs, "summary": summary, "slowdown": slowdown, "in_process": costs},
                 server={"log": str(log_path), "exit_code": server_exit})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
