#!/usr/bin/env python
"""The prefix cache's tiers on multi-turn chat, in one run: real `tokenmill serve` processes driven
by `tokenmill bench serve`'s multiturn workload (and optionally `llama-server --cache-ram` on the
same GGUF file).

The workload (`tokenmill bench --dataset multiturn`): `--num-users` chats of `--num-rounds` rounds
over one shared system prompt of `--system-prompt-len` tokens, each round adding a user message of
`--history-len` tokens and a reply of `--output-len` tokens; requests go round by round, the users
in rotation, `--concurrency` in flight (a closed loop), greedy, EOS ignored. Round 1 is sent first
and the rounds from 2 on are measured as one run (hit rate, TTFT, requests/s). The device's KV
pool is `--num-kv-blocks` blocks (default: room for the `--concurrency` longest requests), so
while the users rotate every chat's history leaves the device before the user comes back; the
report states the working set (the blocks of every chat's last prompt) over the pool.

Configs, each a fresh server on 127.0.0.1 and a free port:
- device: the KV pool only (no host or disk tier);
- tiered: `--host-cache-gb` and `--disk-cache-dir` / `--disk-cache-gb` (a temporary folder unless
  `--disk-cache-dir` is given);
- restart: the tiered server started again on the same disk folder, replaying the rounds from
  `--replay-from` on (the same prompts); its first turns (each user's first request after the
  restart, round `--replay-from`) against those of
- cold: a fresh device-only server sent the same first turns (round `--replay-from` only: the
  later rounds would measure the device config again);
- control: on the device and tiered servers, after the multiturn run, a no-reuse workload:
  per round, `--control-users` prompts of unique text of that round's prompt length (the random
  dataset; no shared prefix), to see what the tiers cost when nothing is reused;
- llama-server (with `--llama-server PATH`): the multiturn run against llama.cpp's server on the
  same GGUF file, `-np --concurrency` slots, a context of the same tokens as tokenmill's pool,
  `--cache-ram` MiB of prompt cache.

Hit rate: the server's `tokenmill_prefix_cache_hits_total / _queries_total` over the run (prompt
tokens found cached, device and host tiers, over prompt tokens looked up); llama-server has none.
`--lock FILE` holds an exclusive flock on FILE while each config runs (start to stop), so other
measurements sharing the host take turns with them but never overlap one.

    python benchmarks/multiturn_cache.py --model PATH/qwen2.5-coder-0.5b-instruct.gguf --llama-server PATH/llama-server
    python benchmarks/multiturn_cache.py --num-users 4 --num-rounds 3 --system-prompt-len 64 --history-len 32 \\
        --output-len 4 --replay-from 2 --configs device,tiered,restart   # smoke test on the default model
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from common import RESULTS_DIR, fmt, print_table, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = RESULTS_DIR / "multiturn_cache.json"
CONFIGS = ("device", "tiered", "restart", "cold", "control")
BLOCK_SIZE = 16  # tokenmill's default block size (the pool and the working set are counted in blocks)
# per message of a chat: what the chat template adds around its content, at most (ChatML: ~5 tokens)
TEMPLATE_TOKENS_PER_MESSAGE = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or .gguf path (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all; restart needs tiered)")
    p.add_argument("--num-users", type=int, default=32, help="chats (default: %(default)s)")
    p.add_argument("--num-rounds", type=int, default=6, help="rounds per chat (default: %(default)s)")
    p.add_argument("--system-prompt-len", type=int, default=1000, help="tokens of the shared system prompt "
                   "(default: %(default)s)")
    p.add_argument("--history-len", type=int, default=300, help="tokens of each round's user message "
                   "(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each reply (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: %(default)s)")
    p.add_argument("--replay-from", type=int, default=4, help="restart and cold replay the rounds from this one on "
                   "(default: %(default)s)")
    p.add_argument("--control-users", type=int, default=None,
                   help="control: prompts per round (default: --num-users)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the device KV pool in blocks of 16 tokens (default: room for --concurrency of the longest "
                        "requests)")
    p.add_argument("--host-cache-gb", type=float, default=2.0, help="tiered: host tier (default: %(default)s)")
    p.add_argument("--disk-cache-gb", type=float, default=8.0, help="tiered: disk tier (default: %(default)s)")
    p.add_argument("--disk-cache-dir", type=Path, default=None,
                   help="tiered: the disk tier's folder, emptied first (default: a temporary folder, removed after)")
    p.add_argument("--server-args", default="", help="more flags for every `tokenmill serve`, e.g. '--dtype float32'")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary: also run the multiturn workload against it")
    p.add_argument("--cache-ram", type=int, default=2048, help="llama-server --cache-ram MiB (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server's /health")
    p.add_argument("--lock", type=Path, default=None, metavar="FILE",
                   help="hold an exclusive flock on FILE while each config runs")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json", help="where to write the JSON")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs: expected a comma-separated subset of {','.join(CONFIGS)}, got {bad or 'nothing'}")
    if "restart" in args.configs and "tiered" not in args.configs:
        p.error("--configs: restart replays on the tiered server's disk folder; add tiered")
    for name in ("num_users", "num_rounds", "system_prompt_len", "history_len", "output_len", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.control_users is None:
        args.control_users = args.num_users
    if args.control_users < 1:
        p.error("--control-users must be >= 1")
    if not 2 <= args.replay_from <= args.num_rounds:
        p.error(f"--replay-from must be in 2..--num-rounds ({args.num_rounds}), got {args.replay_from}")
    return args


# -- the workloads ------------------------------------------------------------------------------


def bench_config(args, tokenizer: Path, **overrides):
    from tokenmill.bench.benchmark import BenchConfig

    fields = dict(base_url="http://localhost", dataset="multiturn", num_users=args.num_users,
                  num_rounds=args.num_rounds, system_prompt_len=args.system_prompt_len, history_len=args.history_len,
                  output_len=str(args.output_len), ignore_eos=True, tokenizer=str(tokenizer), seed=args.seed,
                  concurrency=args.concurrency, percentiles="50,90,99", progress=False)
    return BenchConfig(**{**fields, **overrides})


def control_requests(args, gguf: Path, chats) -> list:
    """Per round, `control_users` prompts of unique text as long as that round's chat prompts."""
    from tokenmill.bench.datasets import build_requests
    from tokenmill.bench.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(str(gguf))
    requests = []
    for r in range(args.num_rounds):
        length = chats[r * args.num_users].target_input_len
        config = bench_config(args, gguf, dataset="random", num_requests=args.control_users, input_len=str(length),
                              seed=args.seed + 1000 + r)
        requests += build_requests(config.dataset_config, tokenizer)
    return requests


def request_blocks(request) -> int:
    """Blocks a request can hold: its prompt (the chat template's tokens counted high) and output."""
    tokens = request.target_input_len + TEMPLATE_TOKENS_PER_MESSAGE * len(request.messages or [None])
    return math.ceil((tokens + request.max_tokens) / BLOCK_SIZE)


def working_set_blocks(args, chats) -> int:
    """Distinct prompt blocks of the workload: the system prompt once, each chat's own part of its
    last prompt once."""
    last = chats[-args.num_users:]
    system = args.system_prompt_len // BLOCK_SIZE
    return system + sum(request_blocks(r) - system for r in last)


# -- servers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def held(lock: Path | None):
    """An exclusive flock on `lock` (nothing when None), released on exit."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def tokenmill_server(args, name: str, flags: list[str]):
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import ServerProcess

    log_path = args.output.parent / "multiturn_cache_logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, *flags, "--log-stats-interval", "0", *shlex.split(args.server_args),
                           log_path=log_path)
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.server_timeout)
        print(f"{name}: tokenmill serve ready in {time.perf_counter() - t0:.1f}s (log {log_path})", flush=True)
        yield server.url, shlex.join(server.proc.args)
    finally:
        server.stop()


@contextlib.contextmanager
def llama_server(args, gguf: Path, num_kv_blocks: int):
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import free_port

    port = free_port()
    command = [args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-np", str(args.concurrency),
               "-c", str(num_kv_blocks * BLOCK_SIZE), "--cache-ram", str(args.cache_ram), "--host", "127.0.0.1",
               "--port", str(port)]
    log_path = args.output.parent / "multiturn_cache_logs" / "llama-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + args.server_timeout
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"llama-server exited with {proc.returncode}; log {log_path}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"llama-server not ready after {args.server_timeout}s; log {log_path}")
                time.sleep(0.2)
            yield url, shlex.join(command)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def warm_up(url: str) -> None:
    """One short request (shorter than a block: it caches nothing), so that no measured request
    pays for the server's first step."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2},
               timeout=120).raise_for_status()


def cache_counters(url: str) -> dict[str, float]:
    """The prefix cache's counters from /metrics (empty for a server without them)."""
    from tests.serving import scrape_metrics

    samples = scrape_metrics(url)
    names = ("tokenmill_prefix_cache_queries_total", "tokenmill_prefix_cache_hits_total",
             "tokenmill_prefix_cache_promotions_total", "tokenmill_prefix_cache_demotions_total",
             "tokenmill_prefix_cache_disk_written_blocks_total", "tokenmill_prefix_cache_disk_read_blocks_total",
             "tokenmill_prefix_cache_disk_corrupt_blocks_total")
    return {n.removeprefix("tokenmill_prefix_cache_"): samples[n] for n in names if n in samples}


# -- measuring ----------------------------------------------------------------------------------


def measure(args, url: str, label: str, requests: list, tokenizer: Path, first_round: int,
            tokenmill: bool = True) -> dict:
    """One bench run of `requests` (whole rounds, users in rotation) and, from a tokenmill server,
    the cache counters it moved."""
    from tokenmill.bench.benchmark import run_benchmark

    before = cache_counters(url) if tokenmill else {}
    config = bench_config(args, tokenizer, base_url=url, label=label)
    run = run_benchmark(config, requests=requests)
    after = cache_counters(url) if tokenmill else {}
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    s = run["summary"]
    if s["failed"]:
        raise SystemExit(f"{label}: {s['failed']} requests failed: {s['errors']}")
    ttft = [r["ttft_s"] for r in run["requests"]]
    rounds = {}
    for r in run["requests"]:
        rounds.setdefault(first_round + r["index"] // args.num_users, []).append(r["ttft_s"] * 1000)
    queries = moved.get("queries_total")
    return {
        "requests": s["completed"],
        "seconds": s["duration_s"],
        "req_per_s": s["request_throughput"],
        "ttft_mean_ms": float(np.mean(ttft)) * 1000,
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1000,
        "ttft_p90_ms": float(np.percentile(ttft, 90)) * 1000,
        "ttft_mean_ms_by_round": {str(k): float(np.mean(v)) for k, v in sorted(rounds.items())},
        "prompt_tokens": s["total_input_tokens"],
        "output_tokens": s["total_output_tokens"],
        "hit_rate": moved.get("hits_total", 0.0) / queries if queries else None,
        "cache_counters": moved,
    }


def multiturn(args, url: str, label: str, chats: list, tokenizer: Path, tokenmill: bool = True) -> dict:
    """Round 1, then the rounds from 2 on, measured."""
    warm_up(url)
    print(f"{label}: round 1 ...", flush=True)
    first = measure(args, url, label, chats[:args.num_users], tokenizer, 1, tokenmill)
    print(f"{label}: rounds 2-{args.num_rounds} ...", flush=True)
    later = measure(args, url, label, chats[args.num_users:], tokenizer, 2, tokenmill)
    return {"round_1": first, "rounds_2_on": later}


def replay(args, url: str, label: str, chats: list, tokenizer: Path, last_round: int) -> dict:
    """The rounds from --replay-from to `last_round`."""
    warm_up(url)
    rounds = f"rounds {args.replay_from}-{last_round}" if last_round > args.replay_from else f"round {last_round}"
    print(f"{label}: replaying {rounds} ...", flush=True)
    sent = chats[(args.replay_from - 1) * args.num_users:last_round * args.num_users]
    run = measure(args, url, label, sent, tokenizer, args.replay_from)
    run["first_turn_ttft_mean_ms"] = run["ttft_mean_ms_by_round"][str(args.replay_from)]
    return run


def control(args, url: str, label: str, requests: list, tokenizer: Path) -> dict:
    print(f"{label}: no-reuse control ...", flush=True)
    return measure(args, url, label, requests, tokenizer, 1)


# -- the report ---------------------------------------------------------------------------------


def rows(runs: dict) -> list[dict]:
    """One row per config: the figures the targets are stated in, and their ratios to the config's
    reference (`ref`): device-only for tiered and llama-server, the control on device-only for the
    control on tiers, cold's first turns for restart's."""
    refs = {"tiered": "device", "llama-server": "device", "control-tiered": "control-device", "restart": "cold"}
    out = []
    for name, run in runs.items():
        figures = run.get("rounds_2_on") or run
        row = {"config": name, "what": run["what"], "server": run["server"], "requests": figures["requests"],
               "hit_rate": figures["hit_rate"], "ttft_mean_ms": figures["ttft_mean_ms"],
               "ttft_p90_ms": figures["ttft_p90_ms"], "req_per_s": figures["req_per_s"],
               "first_turn_ttft_mean_ms": figures.get("first_turn_ttft_mean_ms"),
               "ref": None, "ttft_vs_ref": None, "req_per_s_vs_ref": None}
        ref = runs.get(refs.get(name, ""))
        if ref is not None:
            ref_figures = ref.get("rounds_2_on") or ref
            row["ref"] = refs[name]
            if name == "restart":
                row["ttft_vs_ref"] = figures["first_turn_ttft_mean_ms"] / ref_figures["first_turn_ttft_mean_ms"]
            else:
                row["ttft_vs_ref"] = figures["ttft_mean_ms"] / ref_figures["ttft_mean_ms"]
                row["req_per_s_vs_ref"] = figures["req_per_s"] / ref_figures["req_per_s"]
        out.append(row)
    return out


def targets(runs: dict) -> list[dict]:
    """The targets the tiers are held to, where the configs they compare ran."""
    out = []

    def add(name: str, value: float | None, goal: str, met: bool | None) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met})

    device, tiered = runs.get("device"), runs.get("tiered")
    if tiered:
        t = tiered["rounds_2_on"]
        add("prefix hit rate, rounds >= 2 (tiered)", t["hit_rate"], ">= 0.80", t["hit_rate"] >= 0.80)
    if device and tiered:
        d, t = device["rounds_2_on"], tiered["rounds_2_on"]
        change = t["ttft_mean_ms"] / d["ttft_mean_ms"] - 1
        add("mean TTFT change, rounds >= 2, tiered vs device", change, "<= -0.60", change <= -0.60)
        speedup = t["req_per_s"] / d["req_per_s"]
        add("requests/s, rounds >= 2, tiered / device", speedup, ">= 2", speedup >= 2)
    if runs.get("restart") and runs.get("cold"):
        speedup = runs["cold"]["first_turn_ttft_mean_ms"] / runs["restart"]["first_turn_ttft_mean_ms"]
        add("first-turn TTFT after a restart, cold / restart", speedup, ">= 10", speedup >= 10)
    if runs.get("control-device") and runs.get("control-tiered"):
        change = runs["control-tiered"]["req_per_s"] / runs["control-device"]["req_per_s"] - 1
        add("no-reuse control requests/s, tiered vs device", change, "within ±0.03", abs(change) <= 0.03)
    if runs.get("llama-server") and tiered:
        ll, t = runs["llama-server"]["rounds_2_on"], tiered["rounds_2_on"]
        add("mean TTFT, rounds >= 2, tiered / llama-server", t["ttft_mean_ms"] / ll["ttft_mean_ms"], "< 1",
            t["ttft_mean_ms"] < ll["ttft_mean_ms"])
        add("p90 TTFT, rounds >= 2, tiered / llama-server", t["ttft_p90_ms"] / ll["ttft_p90_ms"], "< 1",
            t["ttft_p90_ms"] < ll["ttft_p90_ms"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like ^C, through the `finally`s that stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tokenmill.bench.benchmark import prepare_requests
    from tokenmill.models.registry import resolve_model

    gguf = resolve_model(args.model)
    if gguf.suffix != ".gguf":
        raise SystemExit(f"this benchmark cuts prompts with the GGUF file's tokenizer; got {gguf}")
    # every server gets the same requests, cut once with the GGUF's tokenizer
    chats = prepare_requests(bench_config(args, gguf))
    largest = max(request_blocks(r) for r in chats)
    num_kv_blocks = args.num_kv_blocks or args.concurrency * largest + args.concurrency
    if num_kv_blocks < largest:
        raise SystemExit(f"--num-kv-blocks {num_kv_blocks}: the longest request needs {largest} blocks")
    working_set = working_set_blocks(args, chats)
    print(f"model {gguf.name}: {args.num_users} users x {args.num_rounds} rounds, system prompt "
          f"{args.system_prompt_len}, +{args.history_len}/round, {args.output_len} output tokens, "
          f"{args.concurrency} in flight; KV pool {num_kv_blocks} blocks, working set {working_set} blocks "
          f"({working_set / num_kv_blocks:.1f}x)", flush=True)
    pool = ["--num-kv-blocks", str(num_kv_blocks)]
    own_dir = args.disk_cache_dir is None
    disk_dir = Path(tempfile.mkdtemp(prefix="multiturn_cache_")) if own_dir else args.disk_cache_dir
    if not own_dir and disk_dir.exists():
        shutil.rmtree(disk_dir)
    tiers = ["--host-cache-gb", str(args.host_cache_gb), "--disk-cache-dir", str(disk_dir),
             "--disk-cache-gb", str(args.disk_cache_gb)]
    no_reuse = control_requests(args, gguf, chats) if "control" in args.configs else None

    runs: dict[str, dict] = {}
    try:
        for name, flags in (("device", pool), ("tiered", pool + tiers)):
            if name not in args.configs:
                continue
            with held(args.lock), tokenmill_server(args, name, flags) as (url, command):
                runs[name] = {"server": command, "what": f"multiturn, rounds 2-{args.num_rounds}",
                              **multiturn(args, url, name, chats, gguf)}
                if no_reuse is not None:
                    runs[f"control-{name}"] = {"server": command, "what": "no-reuse control, every round",
                                               **control(args, url, f"control-{name}", no_reuse, gguf)}
        for name, flags, last in (("restart", pool + tiers, args.num_rounds), ("cold", pool, args.replay_from)):
            if name in args.configs:
                what = f"replay of round{'s' if last > args.replay_from else ''} {args.replay_from}" + (
                    f"-{last}" if last > args.replay_from else "")
                with held(args.lock), tokenmill_server(args, name, flags) as (url, command):
                    runs[name] = {"server": command, "what": what, **replay(args, url, name, chats, gguf, last)}
        if args.llama_server:
            with held(args.lock), llama_server(args, gguf, num_kv_blocks) as (url, command):
                runs["llama-server"] = {"server": command, "what": f"multiturn, rounds 2-{args.num_rounds}",
                                        **multiturn(args, url, "llama-server", chats, gguf, tokenmill=False)}
    finally:
        if own_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)

    results = rows(runs)
    print()
    print_table(["config", "hit rate", "TTFT mean ms", "TTFT p90 ms", "req/s", "first turn ms", "TTFT / ref",
                 "req/s / ref"],
                [[r["config"], fmt(r["hit_rate"], ".1%") if r["hit_rate"] is not None else "-", fmt(r["ttft_mean_ms"]),
                  fmt(r["ttft_p90_ms"]), fmt(r["req_per_s"], ".3f"), fmt(r["first_turn_ttft_mean_ms"]),
                  fmt(r["ttft_vs_ref"], ".2f"), fmt(r["req_per_s_vs_ref"], ".2f")] for r in results])
    print("ref: device for tiered and llama-server, control-device for control-tiered, cold's first turns for "
          "restart's")
    checks = targets(runs)
    for t in checks:
        print(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3f} (goal {t['goal']})")
    write_report(
        args.output, "multiturn_cache",
        config={**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "model_file": str(gguf), "num_kv_blocks": num_kv_blocks, "block_size": BLOCK_SIZE,
                "working_set_blocks": working_set, "working_set_over_pool": working_set / num_kv_blocks},
        results=results, targets=checks, runs=runs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
