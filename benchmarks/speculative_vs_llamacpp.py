#!/usr/bin/env python
"""Speculative decoding against llama.cpp's, over HTTP, on the same GGUF, batch 1, greedy.

Every server is started here and measured on the same tasks:
  tokenmill serve MODEL [--speculative-method M]         for M in `--tokenmill-methods`
  llama-server -m MODEL -t T -np 1 [--spec-type S]        for S in `--llama-spec-types`
All servers run at once, idle but for the one being asked, and each chat goes to every server
in turn before the next chat, so a drift of the host's speed (tens of percent within the hour on
a shared 2-core host) falls on every server alike (`--sequential`: one server at a time, for a
host without the memory for all of them). Tasks (`--tasks`), `--num-prompts` chats each, sent one
at a time, each twice: first for one token (it fills the server's prompt cache and leaves no
answer for a store of earlier outputs to copy), then measured:
  code    rewrite a HumanEval function with type hints (the output repeats the input)
  quote   quote the sentences of a GPL-3 paragraph that mention a topic (summarise with quotes)
  agent   an agent's turns, each a tool-call JSON of the same shape (repeats across requests)
  gsm8k   a GSM8K problem, answered step by step (reasoning: little to copy)
  essay   an open essay on a topic (nothing to copy)
Decode tok/s per task = sum(n - 1) / sum(last chunk - first chunk) over the measured requests,
timed by this client from the SSE stream the same way for both servers (n = the usage's
completion tokens). Drafted and accepted tokens: tokenmill's usage.speculative_decoding,
llama-server's timings.draft_n / draft_n_accepted.

    python benchmarks/speculative_vs_llamacpp.py --model PATH.gguf --llama-server $LCPP/llama-server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import RESULTS_DIR, fmt, print_table, write_report
from speculative import (
    agent_conversations, code_conversations, humaneval_problems, quote_conversations, spread,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = RESULTS_DIR / "speculative_vs_llamacpp.json"
TASKS = ("code", "quote", "agent", "gsm8k", "essay")
ESSAY_TOPICS = ["why cities build bicycle lanes", "the history of the printing press", "how bees communicate",
                "what makes a good teacher", "the future of space travel", "why sleep matters",
                "the role of libraries today", "how volcanoes form"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF file both servers load")
    p.add_argument("--llama-server", metavar="PATH", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--llama-spec-types", default="none,ngram-simple,ngram-map-k,ngram-mod,ngram-cache",
                   help="llama-server --spec-type values, one server each")
    p.add_argument("--tokenmill-methods", default="off,ngram,suffix",
                   help="tokenmill --speculative-method values (off = none), one server each")
    p.add_argument("--tokenmill-args", default="", help="more flags for tokenmill serve")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(TASKS)}")
    p.add_argument("--num-prompts", type=int, default=4, help="chats per task")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request at most (EOS ends it)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t (tokenmill uses as many)")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server's /health")
    p.add_argument("--sequential", action="store_true",
                   help="start and measure one server at a time (less memory; host drift then falls between servers)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json", help="JSON report")
    return p.parse_args(argv)


def gsm8k_conversations(count: int) -> list[list[dict]]:
    from tokenmill.eval.gsm8k import load_gsm8k

    return [[{"role": "user", "content": f"{p.question}\nThink step by step, then give the final number."}]
            for p in load_gsm8k(count)]


def essay_conversations(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write an essay about {ESSAY_TOPICS[i % len(ESSAY_TOPICS)]}."}]
            for i in range(count)]


def task_conversations(names: list[str], count: int) -> dict[str, list[list[dict]]]:
    makers = {
        "code": lambda: code_conversations(problems, spread(count, len(problems))),
        "quote": lambda: quote_conversations(count),
        "agent": lambda: agent_conversations(max(count, 8)),  # the structure repeats across 8 turns
        "gsm8k": lambda: gsm8k_conversations(count),
        "essay": lambda: essay_conversations(count),
    }
    problems = humaneval_problems() if "code" in names else []
    return {name: makers[name]() for name in names}


def stream_chat(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy chat completion, streamed: first and last content chunk times, the usage, and
    the server's own speculation counts."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    usage, timings = {}, {}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                first = first or now
                last = now
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    n = usage.get("completion_tokens", 0)
    spec = usage.get("speculative_decoding") or {}
    return {"completion_tokens": n, "ttft_s": (first or start) - start,
            "decode_s": (last - first) if first and last else 0.0, "wall_s": time.perf_counter() - start,
            "draft_tokens": spec.get("draft_tokens", timings.get("draft_n")),
            "accepted_tokens": spec.get("accepted_tokens", timings.get("draft_n_accepted"))}


def summarize(runs: list[dict]) -> dict:
    """A task's figures from its measured requests."""
    tokens = sum(max(r["completion_tokens"] - 1, 0) for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    drafts = [r["draft_tokens"] for r in runs if r["draft_tokens"] is not None]
    accepted = [r["accepted_tokens"] for r in runs if r["accepted_tokens"] is not None]
    return {"decode_tok_per_s": tokens / seconds if seconds else None,
            "output_tokens": sum(r["completion_tokens"] for r in runs),
            "draft_tokens": sum(drafts) if drafts else None,
            "accepted_tokens": sum(accepted) if accepted else None, "runs": runs}


def measure(urls: list[str], tasks: dict[str, list[list[dict]]], max_tokens: int) -> list[dict]:
    """Each server's figures per task; every chat goes to each server in turn."""
    out: list[dict] = [{} for _ in urls]
    # a connection per request: llama-server may close one after a streamed response
    with httpx.Client(headers={"Connection": "close"}) as client:
        models = [client.get(f"{url}/v1/models").json()["data"][0]["id"] for url in urls]
        for task, chats in tasks.items():
            runs: list[list[dict]] = [[] for _ in urls]
            for messages in chats:
                for i, (url, model) in enumerate(zip(urls, models)):
                    stream_chat(client, url, model, messages, 1)  # fills the prompt cache, and no store of outputs
                    runs[i].append(stream_chat(client, url, model, messages, max_tokens))
            for i, server_runs in enumerate(runs):
                out[i][task] = summarize(server_runs)
            print(f"  {task}: " + ", ".join(fmt(o[task]["decode_tok_per_s"]) for o in out) + " decode tok/s", flush=True)
    return out


class Server:
    """A server process on a free port, its output in a log file, stopped on exit."""

    def __init__(self, command: list[str], port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.command[0]} exited with {self.proc.returncode}; log {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.command[0]} not ready after {timeout}s; log {self.log_path}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def servers(args) -> list[tuple[str, str, list[str]]]:
    """(engine, variant, command) for every server to measure."""
    out = []
    for method in filter(None, args.tokenmill_methods.split(",")):
        flags = [] if method == "off" else ["--speculative-method", method]
        out.append(("tokenmill", method, [sys.executable, "-m", "tokenmill.cli", "serve", args.model, "--host",
                                          "127.0.0.1", *flags, *shlex.split(args.tokenmill_args)]))
    if args.llama_server:
        for spec in filter(None, args.llama_spec_types.split(",")):
            flags = [] if spec == "none" else ["--spec-type", spec]
            out.append(("llama.cpp", spec, [args.llama_server, "-m", args.model, "-t", str(args.threads), "-np", "1",
                                            "-c", "8192", "--host", "127.0.0.1", *flags]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like ^C, so the server being measured is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(REPO_ROOT))
    from tests.serving import free_port
    tasks = task_conversations(args.tasks.split(","), args.num_prompts)
    results = []
    logs = args.output.parent / "speculative_vs_llamacpp_logs"
    logs.mkdir(parents=True, exist_ok=True)
    batches = [[spec] for spec in servers(args)] if args.sequential else [servers(args)]
    for batch in batches:
        with contextlib.ExitStack() as stack:
            started = []
            for engine, variant, command in batch:
                port = free_port()
                command = [*command, "--port", str(port)]
                print(f"{engine} {variant}: starting ...", flush=True)
                server = stack.enter_context(Server(command, port, logs / f"{engine}-{variant}.log"))
                started.append((engine, variant, command, server, server.wait_ready(args.server_timeout)))
            measured = measure([s[3].url for s in started], tasks, args.max_tokens)
        for (engine, variant, command, _, ready), figures in zip(started, measured):
            results.append({"server": f"{engine} {variant}", "engine": engine, "variant": variant,
                            "command": shlex.join(command), "ready_s": ready, "tasks": figures})

    names = list(tasks)
    print(f"\nbatch 1, greedy, up to {args.max_tokens} output tokens, {args.num_prompts} chats per task "
          "(agent: 8 turns), each measured on its second send; decode tok/s")
    print_table(["server", *names], [[r["server"], *(fmt(r["tasks"][t]["decode_tok_per_s"]) for t in names)]
                                     for r in results])
    best = {}
    for task in names:
        for engine in ("tokenmill", "llama.cpp"):
            rates = [(r["tasks"][task]["decode_tok_per_s"] or 0, r["variant"]) for r in results if r["engine"] == engine]
            if rates:
                best.setdefault(task, {})[engine] = dict(zip(("decode_tok_per_s", "variant"), max(rates)))
    for task, b in best.items():
        if len(b) == 2 and b["llama.cpp"]["decode_tok_per_s"]:
            ratio = b["tokenmill"]["decode_tok_per_s"] / b["llama.cpp"]["decode_tok_per_s"]
            b["ratio"] = ratio
            print(f"{task}: best tokenmill ({b['tokenmill']['variant']}) / best llama.cpp "
                  f"({b['llama.cpp']['variant']}) = {ratio:.2f}x")
    write_report(args.output, "speculative_vs_llamacpp", {k: str(v) if isinstance(v, Path) else v
                                                          for k, v in vars(args).items()}, results, best=best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
