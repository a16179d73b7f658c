"""Soak a real server: steady mixed load near a full KV cache for a long time, then check what only
time shows. Writes a JSON summary and a plot of RSS, KV use and latency over time.

The load: clients send completions and chat requests (half of them streaming, temperature 0 or
0.7 with a seed, prompts of 10-150 words, some behind a shared system line, 8-96 output tokens);
5% of them hang up part-way (after a few events, or after a random wait for a non-streaming
answer). A controller adds or removes clients every sample so that the KV cache stays at about
--kv-target of its blocks in use. Every --golden-interval seconds a few greedy "golden" prompts
run among the load; their outputs must equal those the idle server gave at the start (the server
runs fp32, whose greedy output does not depend on the batch: docs/reliability.md#isolation).

Pass (all of):
- no response 5xx nor any other unexpected status, no error event inside a stream, every request
  answered within --request-timeout, the server process the one that started;
- golden outputs identical in every round;
- RSS growth from the end of the warm-up (--warmup, default min(600 s, a third of the run)) to
  the end under --max-rss-growth (5%): the median of the last tenth of the samples against the
  median of the minute after the warm-up;
- when idle again: nothing running, waiting or held open, every device and host KV block free;
- /metrics consistent: choices accepted = stop + length + abort; stop + length between the
  answers the clients read in full and those plus the hang-ups; aborts at most the hang-ups.

    python scripts/soak.py                              # 1 hour against a server it starts
    python scripts/soak.py --duration 180 --output soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --server-pid PID

Without --url it serves the default model as the server tests do (tests/serving.py: fp32) with
a small KV cache (--num-kv-blocks 96 of 16 tokens, 64 host blocks for swapping), so that a
handful of requests fill it and preemption happens. Exit status 0 when the run passed, 1 when not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.serving, which starts the server and reads /metrics
from tests.serving import BASE_FLAGS, MODEL, scrape_metrics  # noqa: E402

SERVER_FLAGS = [*BASE_FLAGS, "--num-kv-blocks", "96", "--block-size", "16", "--num-host-kv-blocks", "64",
                "--max-num-seqs", "64", "--max-waiting-requests", "512"]
SYSTEM = "You are a patient teacher. Answer in plain words, briefly, and give one example."
WORDS = ("river stone light harbor winter garden copper lantern meadow signal orbit valley thunder "
         "paper window forest candle engine pocket mirror ladder violin planet bridge market island "
         "silver shadow kettle marble feather rocket canyon blanket compass").split()
GOLDEN = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
          "Once upon a time, in a small village,"]
GOLDEN_TOKENS = 24
MAX_LISTED = 50  # failures listed in full in the summary (all are counted)
SUCCESS = "tokenmill_request_success_total{finished_reason=%s}"


@dataclass
class Run:
    url: str
    rng: random.Random
    request_timeout: float
    disconnect_rate: float
    stopping: bool = False
    target_clients: int = 4
    records: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    num_failures: int = 0

    def fail(self, kind: str, **detail) -> None:
        self.num_failures += 1
        if len(self.failures) < MAX_LISTED:
            self.failures.append({"kind": kind, "t": round(time.monotonic(), 3), **detail})


def request(rng: random.Random) -> tuple[str, dict]:
    """A random valid request: (path, body)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 150)))
    body = {"model": MODEL, "max_tokens": rng.randint(8, 96), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.7, seed=rng.randrange(2**31))
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"Tell a short story with these words: {text}"}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        return "/v1/chat/completions", {**body, "messages": messages}
    prefix = SYSTEM + "\n" if rng.random() < 0.5 else ""
    return "/v1/completions", {**body, "prompt": f"{prefix}Words: {text}\nA story:"}


async def one_request(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    path, body = request(rng)
    hang_up = rng.random() < run.disconnect_rate
    record = {"path": path, "stream": body["stream"], "hang_up": hang_up, "start": time.monotonic()}
    try:
        if body["stream"]:
            await streamed(run, client, path, body, record, rng.randint(1, 8) if hang_up else None)
        elif hang_up:
            try:  # queued, prefilling or decoding when the client leaves
                r = await asyncio.wait_for(client.post(run.url + path, json=body), timeout=rng.uniform(0.05, 2.0))
                answered(run, r, record)
            except asyncio.TimeoutError:
                record["outcome"] = "hung_up"
        else:
            answered(run, await client.post(run.url + path, json=body, timeout=run.request_timeout), record)
    except httpx.TimeoutException:
        record["outcome"] = "no_answer"
        run.fail("no_answer", path=path, stream=body["stream"])
    except httpx.TransportError as e:
        record["outcome"] = "transport_error"
        run.fail("transport_error", path=path, error=repr(e))
    except (ValueError, KeyError, IndexError) as e:  # an answer that is not what the API promises
        record["outcome"] = "bad_answer"
        run.fail("bad_answer", path=path, error=repr(e))
    record["end"] = time.monotonic()
    run.records.append(record)


def answered(run: Run, r: httpx.Response, record: dict) -> None:
    record["status"] = r.status_code
    if r.status_code != 200:
        record["outcome"] = "error_status"
        run.fail("5xx" if r.status_code >= 500 else "unexpected_status", status=r.status_code, body=r.text[:500])
        return
    record["outcome"] = "completed"
    record["finish_reason"] = r.json()["choices"][0]["finish_reason"]


async def streamed(run: Run, client, path: str, body: dict, record: dict, hang_up_after: int | None) -> None:
    async with client.stream("POST", run.url + path, json=body, timeout=run.request_timeout) as r:
        record["status"] = r.status_code
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            record["outcome"] = "error_status"
            run.fail("5xx" if r.status_code >= 500 else "unexpected_status", status=r.status_code, body=text[:500])
            return
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                record["outcome"] = "completed"
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record["outcome"] = "stream_error"
                run.fail("stream_error", path=path, event=line[:500])
                return
            events += 1
            if events == 1:
                record["ttft"] = time.monotonic() - record["start"]
            for choice in chunk.get("choices", []):
                record["finish_reason"] = choice.get("finish_reason") or record.get("finish_reason")
            if hang_up_after is not None and events >= hang_up_after:
                record["outcome"] = "hung_up"  # leaving the block closes the connection
                return
        record["outcome"] = "stream_error"
        run.fail("stream_error", path=path, event="the stream ended without [DONE]")


async def client_loop(run: Run, index: int, client: httpx.AsyncClient) -> None:
    rng = random.Random(run.rng.randrange(2**31))
    while not run.stopping and index < run.target_clients:
        await one_request(run, client, rng)


async def golden(run: Run, client: httpx.AsyncClient) -> list[str]:
    async def one(prompt):
        try:
            r = await client.post(run.url + "/v1/completions", timeout=run.request_timeout,
                                  json={"model": MODEL, "prompt": prompt, "max_tokens": GOLDEN_TOKENS, "temperature": 0})
        except httpx.HTTPError as e:
            run.fail("no_answer" if isinstance(e, httpx.TimeoutException) else "transport_error", path="golden",
                     error=repr(e))
            return None
        run.records.append({"path": "golden", "stream": False, "hang_up": False, "status": r.status_code,
                            "outcome": "completed" if r.status_code == 200 else "error_status",
                            "finish_reason": r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None})
        if r.status_code != 200:
            run.fail("5xx" if r.status_code >= 500 else "unexpected_status", status=r.status_code, body=r.text[:500])
            return None
        return r.json()["choices"][0]["text"]

    return await asyncio.gather(*(one(p) for p in GOLDEN))


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def wait_idle(url: str, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(scrape_metrics, url)
        if (m["tokenmill_num_requests_running"] == m["tokenmill_num_requests_waiting"] == 0
                and m["tokenmill_num_requests_open"] == 0):
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


async def soak_async(url: str, *, duration: float, warmup: float, server_pid: int | None, seed: int,
                     kv_target: float, disconnect_rate: float, golden_interval: float, sample_interval: float,
                     request_timeout: float, max_rss_growth: float, max_clients: int) -> dict:
    run = Run(url, random.Random(seed), request_timeout, disconnect_rate)
    limits = httpx.Limits(max_connections=max_clients + 16, max_keepalive_connections=max_clients + 16)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        start = await wait_idle(url, 60)
        reference = await golden(run, client)
        run.records.clear()
        start = await wait_idle(url, 60)  # counters and records from here on
        t0 = time.monotonic()
        clients: dict[int, asyncio.Task] = {}
        timeline: list[dict] = []
        golden_rounds, golden_mismatches = 0, []
        golden_task: asyncio.Task | None = None
        next_golden = t0 + golden_interval
        seen = 0
        while (now := time.monotonic()) < t0 + duration:
            for i in range(run.target_clients):  # (re)start the clients the target asks for
                if i not in clients or clients[i].done():
                    clients[i] = asyncio.create_task(client_loop(run, i, client))
            if golden_task is None and now >= next_golden:
                golden_task = asyncio.create_task(golden(run, client))
            if golden_task is not None and golden_task.done():
                golden_rounds += 1
                if golden_task.result() != reference:
                    golden_mismatches.append({"t": round(now - t0, 1), "got": golden_task.result()})
                    run.fail("golden_mismatch", t=round(now - t0, 1))
                golden_task, next_golden = None, now + golden_interval
            await asyncio.sleep(sample_interval)
            m = await asyncio.to_thread(scrape_metrics, url)
            done = [r for r in run.records[seen:] if r["path"] != "golden" and "end" in r]
            seen = len(run.records)
            latencies = [r["end"] - r["start"] for r in done if r.get("outcome") == "completed"]
            usage, waiting = m["tokenmill_kv_cache_usage_perc"], m["tokenmill_num_requests_waiting"]
            timeline.append({
                "t": round(time.monotonic() - t0, 2), "rss_bytes": rss_bytes(server_pid), "kv_usage": usage,
                "running": m["tokenmill_num_requests_running"], "waiting": waiting, "clients": run.target_clients,
                "completed": len(latencies), "e2e_p50_s": percentile(latencies, 0.5),
                "e2e_p95_s": percentile(latencies, 0.95),
                "ttft_p50_s": percentile([r["ttft"] for r in done if "ttft" in r], 0.5),
            })
            # keep the cache near its target: one client more or fewer per sample
            if usage < kv_target - 0.05 and waiting == 0:
                run.target_clients = min(max_clients, run.target_clients + 1)
            elif usage > kv_target + 0.05 or waiting > 4:
                run.target_clients = max(1, run.target_clients - 1)
        run.stopping = True
        await asyncio.gather(*clients.values(), *([golden_task] if golden_task else []))
        if golden_task is not None:
            golden_rounds += 1
            if golden_task.result() != reference:
                golden_mismatches.append({"t": round(time.monotonic() - t0, 1), "got": golden_task.result()})
                run.fail("golden_mismatch", t="end")
        wall = time.monotonic() - t0
        end = await wait_idle(url, 60)
        health = (await client.get(url + "/health", timeout=10)).status_code
    return summarize(run, start, end, timeline, wall, warmup, max_rss_growth, reference, golden_rounds,
                     golden_mismatches, health, kv_target, seed)


def summarize(run: Run, start: dict, end: dict, timeline: list[dict], wall: float, warmup: float,
              max_rss_growth: float, reference: list, golden_rounds: int, golden_mismatches: list, health: int,
              kv_target: float, seed: int) -> dict:
    outcomes: dict[str, int] = {}
    for r in run.records:
        outcomes[r.get("outcome", "unknown")] = outcomes.get(r.get("outcome", "unknown"), 0) + 1
    delta = lambda name: end.get(name, 0) - start.get(name, 0)  # noqa: E731
    finished = {reason: delta(SUCCESS % reason) for reason in ("stop", "length", "abort")}
    accepted = delta("tokenmill_request_accepted_total")
    completed, hung_up = outcomes.get("completed", 0), outcomes.get("hung_up", 0)
    metrics_ok = (accepted == sum(finished.values())
                  and completed <= finished["stop"] + finished["length"] <= completed + hung_up
                  and finished["abort"] <= hung_up)
    idle_ok = (end["tokenmill_num_requests_running"] == end["tokenmill_num_requests_waiting"] == 0
               and end["tokenmill_num_requests_open"] == 0
               and end["tokenmill_kv_cache_free_blocks"] == end["tokenmill_kv_cache_blocks"]
               == start["tokenmill_kv_cache_free_blocks"]
               and end["tokenmill_kv_cache_free_host_blocks"] == end["tokenmill_kv_cache_host_blocks"])

    rss = [(s["t"], s["rss_bytes"]) for s in timeline if s["rss_bytes"] is not None]
    base = [b for t, b in rss if warmup <= t < warmup + 60]
    tail = [b for _, b in rss[-max(1, len(rss) // 10):]]
    growth = (statistics.median(tail) - statistics.median(base)) / statistics.median(base) if base and tail else None
    loaded = [s["kv_usage"] for s in timeline if s["t"] >= min(warmup, 30)]
    summary = {
        "seed": seed, "wall_s": round(wall, 1), "warmup_s": warmup, "requests": len(run.records),
        "by_outcome": outcomes, "num_failures": run.num_failures, "failures": run.failures,
        "golden": {"rounds": golden_rounds, "mismatches": golden_mismatches, "reference": reference},
        "rss": {"start_bytes": rss[0][1] if rss else None, "after_warmup_bytes": statistics.median(base) if base else None,
                "end_bytes": statistics.median(tail) if tail else None, "growth": growth,
                "max_growth": max_rss_growth},
        "kv": {"target": kv_target, "mean_usage": statistics.fmean(loaded) if loaded else None,
               "blocks": end["tokenmill_kv_cache_blocks"], "free_blocks_start": start["tokenmill_kv_cache_free_blocks"],
               "free_blocks_end": end["tokenmill_kv_cache_free_blocks"],
               "host_blocks": end["tokenmill_kv_cache_host_blocks"],
               "free_host_blocks_end": end["tokenmill_kv_cache_free_host_blocks"],
               "preemptions": delta("tokenmill_num_preemptions_total"),
               "swapped_out_blocks": delta("tokenmill_swapped_out_blocks_total")},
        "metrics": {"accepted": accepted, "finished": finished, "client_completed": completed,
                    "client_hung_up": hung_up, "consistent": metrics_ok},
        "idle_after": idle_ok, "health_after": health, "timeline": timeline,
    }
    summary["passed"] = (run.num_failures == 0 and not golden_mismatches and golden_rounds > 0 and metrics_ok
                         and idle_ok and health == 200 and growth is not None and growth < max_rss_growth)
    return summary


def soak(url: str, *, duration: float, warmup: float | None = None, server_pid: int | None = None, seed: int = 0,
         kv_target: float = 0.9, disconnect_rate: float = 0.05, golden_interval: float = 30.0,
         sample_interval: float = 1.0, request_timeout: float = 120.0, max_rss_growth: float = 0.05,
         max_clients: int = 48) -> dict:
    """Run the soak against a server at `url` (whose process is `server_pid`, for its RSS)."""
    warmup = min(600.0, duration / 3) if warmup is None else warmup
    return asyncio.run(soak_async(
        url.rstrip("/"), duration=duration, warmup=warmup, server_pid=server_pid, seed=seed, kv_target=kv_target,
        disconnect_rate=disconnect_rate, golden_interval=golden_interval, sample_interval=sample_interval,
        request_timeout=request_timeout, max_rss_growth=max_rss_growth, max_clients=max_clients))


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = summary["timeline"]
    minutes = [s["t"] / 60 for s in tl]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(minutes, [(s["rss_bytes"] or 0) / 2**20 for s in tl])
    axes[0].axvline(summary["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    axes[0].set_ylabel("server RSS (MiB)")
    axes[0].legend(loc="lower right")
    axes[1].plot(minutes, [100 * s["kv_usage"] for s in tl], label="KV blocks in use (%)")
    axes[1].plot(minutes, [s["running"] for s in tl], label="running requests")
    axes[1].set_ylabel("KV use, running")
    axes[1].legend(loc="lower right")
    for key, label in (("e2e_p50_s", "end-to-end p50"), ("e2e_p95_s", "end-to-end p95"), ("ttft_p50_s", "TTFT p50")):
        axes[2].plot(minutes, [s[key] for s in tl], label=label)
    axes[2].set_ylabel("latency (s)")
    axes[2].set_xlabel("minutes")
    axes[2].legend(loc="upper right")
    growth = summary["rss"]["growth"]
    fig.suptitle(f"soak: {summary['requests']} requests, {summary['num_failures']} failures, RSS growth after "
                 f"warm-up {100 * growth:+.2f}%" if growth is not None else "soak")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default: 3600)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before RSS growth is measured (default: min(600, duration / 3))")
    parser.add_argument("--url", default=None, help="a running server (default: start one on 127.0.0.1)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --url: its process, for RSS")
    parser.add_argument("--seed", type=int, default=0, help="seed of the load (default: 0)")
    parser.add_argument("--kv-target", type=float, default=0.9, help="fraction of KV blocks to keep in use (0.9)")
    parser.add_argument("--disconnect-rate", type=float, default=0.05, help="fraction of clients that hang up (0.05)")
    parser.add_argument("--golden-interval", type=float, default=60.0, help="seconds between golden rounds (60)")
    parser.add_argument("--sample-interval", type=float, default=2.0, help="seconds between samples (2)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take before it counts as unanswered (120)")
    parser.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth after warm-up (0.05)")
    parser.add_argument("--max-clients", type=int, default=48, help="most concurrent clients (48)")
    parser.add_argument("--output", type=Path, default=Path("soak.json"),
                        help="JSON summary; the plot goes beside it as .png (default: soak.json)")
    args = parser.parse_args(argv)

    server, pid = None, args.server_pid
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        if args.url is None:
            from tests.serving import ServerProcess

            server = ServerProcess(MODEL, *SERVER_FLAGS, log_path=Path(tmp) / "server.log").wait_ready()
            url, pid = server.url, server.proc.pid
            print(f"serving {MODEL} at {url} (pid {pid}): tokenmill serve {MODEL} {' '.join(SERVER_FLAGS)}", flush=True)
        else:
            url = args.url
        try:
            summary = soak(url, duration=args.duration, warmup=args.warmup, server_pid=pid, seed=args.seed,
                           kv_target=args.kv_target, disconnect_rate=args.disconnect_rate,
                           golden_interval=args.golden_interval, sample_interval=args.sample_interval,
                           request_timeout=args.request_timeout, max_rss_growth=args.max_rss_growth,
                           max_clients=args.max_clients)
            if server is not None:
                summary["same_process_after"] = server.proc.poll() is None
                summary["passed"] = summary["passed"] and summary["same_process_after"]
                summary["server"] = {"model": MODEL, "flags": SERVER_FLAGS, "pid": pid}
        finally:
            if server is not None:
                server.stop()
        if not summary["passed"] and server is not None:
            print(server.log_path.read_text()[-5000:], file=sys.stderr)
    args.output.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, args.output.with_suffix(".png"))
    rss, kv, m = summary["rss"], summary["kv"], summary["metrics"]
    print(f"{summary['requests']} requests in {summary['wall_s']} s: {summary['by_outcome']}; failures "
          f"{summary['num_failures']}; golden rounds {summary['golden']['rounds']}, mismatches "
          f"{len(summary['golden']['mismatches'])}; mean KV use {kv['mean_usage']:.2f}, {kv['preemptions']:.0f} "
          f"preemptions; RSS growth after warm-up {100 * (rss['growth'] or 0):+.2f}%; metrics consistent "
          f"{m['consistent']} ({m}); idle after {summary['idle_after']} -> "
          f"{'PASSED' if summary['passed'] else 'FAILED'} (summary: {args.output})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
