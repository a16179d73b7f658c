#!/usr/bin/env python
"""Serving under load: the real `tokenmill serve` over HTTP, driven by `tokenmill bench serve`'s load
generator, vs the same workloads against an already-running llama.cpp `llama-server`
(`--llama-server URL`) and, offline, Hugging Face `generate` in static batches.

Workloads (`--workloads`, default both; EOS ignored, greedy, `--concurrency` requests in flight in a
closed loop, `--num-requests` requests, prompts cut from GPL-3 text):
- short: prompts of 16:64 tokens, 128 output tokens;
- long:  prompts of 64:512 tokens, 128:256 output tokens.
The prompts are cut once per workload with one local tokenizer (the GGUF's), so every server gets
byte-identical requests.

tokenmill: `tokenmill serve MODEL --host 127.0.0.1 --port FREE_PORT [--server-args ...]` is started
as a subprocess (tests/serving.py's ServerProcess), waited for (/health 200), benchmarked, and
stopped with SIGTERM at the end, also on an error. Its log goes next to the JSON output.

llama.cpp: start it yourself first (ctx `-c` is split across the `-np` slots), e.g.
    llama-server -m GGUF -t 2 -np 64 -c 65536 --port 8081
and pass `--llama-server http://127.0.0.1:8081`. Start a fresh one for each run: its slots keep the
last run's prompts cached, and a second run of the same prompts skips their prefill. Run nothing
else meanwhile: the two servers are measured one after the other, and an idle llama-server holds
its memory but no CPU.

Hugging Face (`--skip-hf` to leave out): the same prompts, tokenized, through `generate` in static,
left-padded batches of `--hf-batch-size` in request order, each batch to its longest output. Offline
(no HTTP, no streaming): output tok/s only.

Reported: output tok/s, TTFT p50/p99, ITL p50/p99 and TPOT p50/p99 (as `tokenmill bench serve`
computes them, on the client's clock).

    python benchmarks/serving_load.py --llama-server http://127.0.0.1:8081
    python benchmarks/serving_load.py --workloads short --num-requests 4 --concurrency 4 --output-len 8 --hf-batch-size 4   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import logging
import shlex
import signal
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR, TEXT_FILE, busy_warning, device_name, fmt, hf_generate_batch, hf_pad_id, load_hf, print_table, run_hf,
    write_report,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = RESULTS_DIR / "serving_load.json"
WORKLOADS = {
    "short": {"input_len": "16:64", "output_len": "128"},
    "long": {"input_len": "64:512", "output_len": "128:256"},
}
LLAMA_SERVER_EXAMPLE = "llama-server -m GGUF -t 2 -np 64 -c 65536 --port 8081"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="Serving under load: tokenmill serve (started here) and an already-running llama.cpp llama-server, "
        "driven by tokenmill's bench client, and Hugging Face generate in static batches (offline).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file) served by tokenmill")
    p.add_argument("--workloads", default="short,long",
                   help="comma-separated: short (16:64 prompt tokens, 128 output) and/or long (64:512 prompt, 128:256 output)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (closed loop)")
    p.add_argument("--num-requests", type=int, default=128, help="measured requests per workload and server")
    p.add_argument("--output-len", default=None, metavar="N|MIN:MAX",
                   help="override every workload's output length (smoke tests); default: the workload's")
    p.add_argument("--num-warmups", type=int, default=2,
                   help="requests sent and discarded before each measured run")
    p.add_argument("--server-args", default="",
                   help="extra flags for `tokenmill serve`, one string; write it with '=' "
                        "(--server-args=\"--dtype bfloat16 --quantization int8\") so a single flag is not taken for "
                        "one of this script's")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for tokenmill's /health")
    p.add_argument("--skip-tokenmill", action="store_true", help="do not start or measure tokenmill serve")
    p.add_argument("--llama-server", metavar="URL", default=None,
                   help=f"root URL of a running llama.cpp llama-server to measure too, e.g. http://127.0.0.1:8081; "
                        f"start it first with `{LLAMA_SERVER_EXAMPLE}` (-c is split across the -np slots)")
    p.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face transformers reference")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the HF generate reference")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default=d.resolved_dtype("cpu"),
                   help="dtype of the HF model; the default is what tokenmill serve's dtype auto resolves to on this "
                        "CPU (pass the server's --dtype if --server-args sets one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created; the tokenmill server's log goes "
                        "next to it as PATH.server.log)")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if not args.workloads or bad:
        p.error(f"--workloads: expected a comma-separated subset of {','.join(WORKLOADS)}, got {bad or 'nothing'}")
    for name in ("concurrency", "num_requests", "hf_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.skip_tokenmill and not args.llama_server and args.skip_hf:
        p.error("nothing to measure")
    return args


def bench_config(args, workload: str, base_url: str, label: str, tokenizer_path: Path):
    from tokenmill.bench.benchmark import BenchConfig

    w = WORKLOADS[workload]
    return BenchConfig(
        base_url=base_url, label=label, dataset="random", num_requests=args.num_requests,
        input_len=w["input_len"], output_len=args.output_len or w["output_len"], ignore_eos=True,
        tokenizer=str(tokenizer_path), seed=args.seed, concurrency=args.concurrency, num_warmups=args.num_warmups,
        percentiles="50,90,99", progress=False,
    )


def run_server_workloads(args, label: str, base_url: str, workloads: dict, tokenizer_path: Path) -> list[dict]:
    from tokenmill.bench.benchmark import run_benchmark
    from tokenmill.bench.report import format_run

    runs = []
    for name, requests in workloads.items():
        print(f"{label}: workload {name} ...", flush=True)
        config = bench_config(args, name, base_url, label, tokenizer_path)
        result = run_benchmark(config, requests=requests)
        print(format_run(result), flush=True)
        runs.append({"engine": label, "workload": name, **result})
    return runs


def check_reachable(url: str) -> None:
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/health", timeout=10)
    except httpx.HTTPError as e:
        raise SystemExit(f"--llama-server {url}: not reachable ({e}); start it first, e.g. `{LLAMA_SERVER_EXAMPLE}`")
    if r.status_code != 200:
        raise SystemExit(f"--llama-server {url}: /health answered {r.status_code} ({r.text[:200]})")


def run_tokenmill(args, workloads: dict, tokenizer_path: Path, log_path: Path) -> tuple[list[dict], dict]:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import ServerProcess

    flags = shlex.split(args.server_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, *flags, log_path=log_path)
    info = {"command": server.proc.args, "log": str(log_path), "url": server.url}
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.server_timeout)
        info["ready_seconds"] = time.perf_counter() - t0
        print(f"tokenmill serve ready at {server.url} in {info['ready_seconds']:.1f}s (log {log_path})", flush=True)
        return run_server_workloads(args, "tokenmill", server.url, workloads, tokenizer_path), info
    finally:
        info["exit_code"] = server.stop()
        info["engine_ready"] = next((line.strip() for line in log_path.read_text().splitlines() if "engine ready" in line),
                                    None)


def hf_row(args, model, tokenizer, name: str, requests) -> dict:
    work = [(tokenizer.encode(r.prompt), r.max_tokens) for r in requests]
    result, _ = run_hf(model, tokenizer, work, args.hf_batch_size, sort_by_length=False)
    return {**result, "engine": f"hf-transformers (offline, static batches of {args.hf_batch_size}, no HTTP)",
            "workload": name, "dtype": args.hf_dtype}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # a SIGTERM to this script unwinds through the `finally` that stops the server
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from tokenmill.bench.benchmark import prepare_requests
    from tokenmill.models.registry import resolve_model

    model_path = resolve_model(args.model)
    if model_path.suffix != ".gguf":
        raise SystemExit(f"this benchmark cuts prompts with the GGUF file's tokenizer; got {model_path}")
    if args.llama_server:
        check_reachable(args.llama_server)

    # The workloads, cut once with the GGUF's tokenizer: the same requests for every server.
    workloads = {}
    for name in args.workloads:
        workloads[name] = prepare_requests(bench_config(args, name, "http://localhost", "-", model_path))
    print(f"model {model_path.name}; workloads {', '.join(args.workloads)}: {args.num_requests} requests, "
          f"concurrency {args.concurrency}; {device_name('cpu')}", flush=True)

    results: list[dict] = []
    server_info = None
    if not args.skip_tokenmill:
        log_path = args.output.with_suffix(".server.log")
        runs, server_info = run_tokenmill(args, workloads, model_path, log_path)
        results += runs
    if args.llama_server:
        results += run_server_workloads(args, "llama-server", args.llama_server, workloads, model_path)
    if not args.skip_hf:
        from transformers import AutoTokenizer

        print(f"hf-transformers: loading ({args.hf_dtype}) ...", flush=True)
        model = load_hf(model_path, args.hf_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
        hf_generate_batch(model, [tokenizer.encode("warm up the model")] * 2, 4, hf_pad_id(model, tokenizer))
        for name, requests in workloads.items():
            print(f"hf-transformers: workload {name} ...", flush=True)
            results.append(hf_row(args, model, tokenizer, name, requests))
        del model
        gc.collect()

    print()
    header = ["workload", "engine", "ok", "output tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
              "TPOT p99"]
    rows = []
    for name in args.workloads:
        for r in (r for r in results if r["workload"] == name):
            s = r.get("summary")
            if s is None:  # HF, offline
                rows.append([name, r["engine"], f"{r['requests']}/{r['requests']}", fmt(r["output_tok_per_s"]),
                             *["-"] * 6])
                continue
            rows.append([name, r["engine"], f"{s['completed']}/{s['num_sent']}", fmt(s["output_throughput"]),
                         fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]),
                         fmt(s["itl_ms"]["p99"]), fmt(s["tpot_ms"]["p50"]), fmt(s["tpot_ms"]["p99"])])
    print_table(header, rows, left=2)
    print()
    print(f"latencies in ms on the client's clock; {args.concurrency} in flight, {args.num_requests} requests; "
          "HF: requested output tokens / wall time over its static batches, no latencies (offline)")
    # (the servers' runs record the client's load average instead: their own CPU time is the server's)
    warning = busy_warning({f"{r['engine']} {r['workload']}": r["other_processes_cores"]
                            for r in results if "summary" not in r})
    if warning:
        print(warning)

    write_report(
        args.output,
        "serving_load",
        config={
            "model": args.model,
            "model_file": str(model_path),
            "workloads": {name: {**WORKLOADS[name], **({"output_len": args.output_len} if args.output_len else {})}
                          for name in args.workloads},
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "num_warmups": args.num_warmups,
            "server_args": args.server_args,
            "llama_server": args.llama_server,
            "hf_batch_size": None if args.skip_hf else args.hf_batch_size,
            "hf_dtype": None if args.skip_hf else args.hf_dtype,
            "seed": args.seed,
            "text_file": str(TEXT_FILE),
            "greedy": True,
            "ignore_eos": True,
        },
        results=results,
        tokenmill_server=server_info,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
