"""Fuzz tokenmill's HTTP API with schemathesis and write a JSON summary.

Every operation of the served /openapi.json, in positive mode (bodies the schema allows) and in
negative mode (bodies and methods it does not), through schemathesis' examples, coverage and
fuzzing phases, against one real `tokenmill serve` on 127.0.0.1. scripts/fuzz_hooks.py keeps
each call to a few decode steps and records every exchange. The run passes when no response is
a 5xx (nor a server error inside an event stream), every request is answered within
--request-timeout, /health answers 200 afterwards and the server process is the one that
started (still running).

    python scripts/fuzz_api.py                        # 10 minutes against a server it starts
    python scripts/fuzz_api.py --duration 60 --output fuzz.json
    python scripts/fuzz_api.py --max-examples 20      # bounded by examples per operation, not time
    python scripts/fuzz_api.py --url http://127.0.0.1:8000   # a server already running

Without --url it serves the default model as the server tests do (tests/serving.py: fp32, a
0.25 GB KV cache) with the Hermes tool-calling chat template of the tests, so that `tools`
reach the model too. Exit status 0 when the run passed, 1 when not.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.serving, which starts the server
HOOKS = REPO / "scripts" / "fuzz_hooks.py"
CHAT_TEMPLATE = REPO / "tests" / "entrypoints" / "data" / "hermes_tools.jinja"
PHASES = "examples,coverage,fuzzing"
MAX_LISTED = 50  # failures listed in full in the summary (all are counted)


def server_flags() -> list[str]:
    """The flags of the server this script starts: the server tests' own, and tools in the template."""
    from tests.serving import BASE_FLAGS

    return [*BASE_FLAGS, "--chat-template", str(CHAT_TEMPLATE)]


def schemathesis_command(url: str, *, duration: float | None, max_examples: int | None, seed: int,
                         request_timeout: float, workers: int) -> list[str]:
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
               "--mode", "all", "--phases", PHASES, "--checks", "not_a_server_error",
               "--workers", str(workers), "--request-timeout", str(request_timeout), "--seed", str(seed),
               "--continue-on-failure", "--suppress-health-check", "all", "--no-color"]
    if duration is not None:
        command += ["--max-time", str(max(1, round(duration)))]
    if max_examples is not None:
        command += ["--max-examples", str(max_examples)]
    return command


def run_schemathesis(url: str, work_dir: Path, *, duration: float | None = None, max_examples: int | None = None,
                     seed: int = 0, request_timeout: float = 60.0, workers: int = 1) -> tuple[int, Path, list[str]]:
    """Run `st run` against `url`; returns (its exit status, the exchange log, the command)."""
    log = work_dir / "exchanges.jsonl"
    log.unlink(missing_ok=True)
    command = schemathesis_command(url, duration=duration, max_examples=max_examples, seed=seed,
                                   request_timeout=request_timeout, workers=workers)
    env = dict(os.environ, SCHEMATHESIS_HOOKS=str(HOOKS), TOKENMILL_FUZZ_LOG=str(log),
               TOKENMILL_FUZZ_TIMEOUT=str(request_timeout))
    # schemathesis keeps its example database in the working directory: a scratch one, not the checkout
    with open(work_dir / "schemathesis.out", "w") as out:
        proc = subprocess.run(command, cwd=work_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    log.touch()
    return proc.returncode, log, command


def summarize(records: list[dict]) -> dict:
    """Counts per status, per operation and per (phase, mode); every 5xx, server error inside an
    event stream and unanswered request, with the request that caused it."""
    by_status: collections.Counter = collections.Counter()
    by_operation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_phase_mode: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    server_errors, stream_errors, no_answer, slow = [], [], [], []
    for r in records:
        status = "no answer" if r.get("no_answer") else str(r["status"])
        by_status[status] += 1
        by_operation[r["operation"]][status] += 1
        by_phase_mode[f"{r['phase']}/{r['mode']}"][status] += 1
        if r.get("no_answer"):
            no_answer.append(r)
        elif r["status"] >= 500:
            server_errors.append(r)
        elif "stream_error" in r:
            stream_errors.append(r)
        elif "request" in r:
            slow.append(r)
    return {
        "requests": len(records),
        "by_status": dict(sorted(by_status.items())),
        "by_operation": {op: dict(sorted(c.items())) for op, c in sorted(by_operation.items())},
        "by_phase_mode": {k: dict(sorted(c.items())) for k, c in sorted(by_phase_mode.items())},
        "num_server_errors": len(server_errors),
        "num_stream_errors": len(stream_errors),
        "num_no_answer": len(no_answer),
        "server_errors": server_errors[:MAX_LISTED],
        "stream_errors": stream_errors[:MAX_LISTED],
        "no_answer": no_answer[:MAX_LISTED],
        "slowest": sorted(slow, key=lambda r: -r["elapsed"])[:MAX_LISTED],  # answered, after SLOW_S or more
    }


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.TransportError:
        return None


def fuzz(url: str, work_dir: Path, *, duration: float | None = None, max_examples: int | None = None, seed: int = 0,
         request_timeout: float = 60.0, workers: int = 1, server_alive=lambda: None) -> dict:
    """One schemathesis run against `url` and its summary; `server_alive()` says whether the
    server process that started is still running (None: not known, a server given by URL)."""
    started = time.monotonic()
    rc, log, command = run_schemathesis(url, work_dir, duration=duration, max_examples=max_examples, seed=seed,
                                        request_timeout=request_timeout, workers=workers)
    summary = {
        "command": " ".join(command[1:]).replace("-m schemathesis.cli", "st", 1),
        "seed": seed, "duration_s": duration, "max_examples": max_examples, "request_timeout_s": request_timeout,
        "wall_s": round(time.monotonic() - started, 1), "schemathesis_exit_status": rc,
        **summarize(read_log(log)),
        "health_after": health(url), "server_alive_after": server_alive(),
    }
    summary["passed"] = (summary["requests"] > 0 and summary["num_server_errors"] == 0
                         and summary["num_stream_errors"] == 0 and summary["num_no_answer"] == 0
                         and summary["health_after"] == 200 and summary["server_alive_after"] is not False)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of fuzzing; 0 = no time bound, with --max-examples (default: 600)")
    parser.add_argument("--max-examples", type=int, default=None, help="examples per operation and mode")
    parser.add_argument("--url", default=None, help="a running server (default: start one on 127.0.0.1)")
    parser.add_argument("--seed", type=int, default=None, help="schemathesis' seed (default: random, printed)")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds each request may take before it counts as unanswered (default: 60)")
    parser.add_argument("--workers", type=int, default=1, help="concurrent schemathesis workers (default: 1)")
    parser.add_argument("--output", type=Path, default=Path("fuzz_api_summary.json"),
                        help="where the JSON summary goes (default: fuzz_api_summary.json)")
    args = parser.parse_args(argv)
    duration = args.duration or None
    if duration is None and args.max_examples is None:
        parser.error("give --duration or --max-examples")
    seed = args.seed if args.seed is not None else random.randrange(2**31)

    with tempfile.TemporaryDirectory(prefix="fuzz_api_") as tmp:
        work_dir = Path(tmp)
        server = None
        if args.url is None:
            from tests.serving import MODEL, ServerProcess

            flags = server_flags()
            server = ServerProcess(MODEL, *flags, log_path=work_dir / "server.log").wait_ready()
            url, alive = server.url, (lambda: server.proc.poll() is None)
            print(f"serving {MODEL} at {url} (pid {server.proc.pid}): tokenmill serve {MODEL} {' '.join(flags)}",
                  flush=True)
        else:
            url, alive = args.url.rstrip("/"), (lambda: None)
        summary: dict = {}
        try:
            summary = fuzz(url, work_dir, duration=duration, max_examples=args.max_examples, seed=seed,
                           request_timeout=args.request_timeout, workers=args.workers, server_alive=alive)
            if server is not None:
                summary["server"] = {"model": MODEL, "flags": flags, "pid": server.proc.pid}
            args.output.write_text(json.dumps(summary, indent=2) + "\n")
        finally:
            if server is not None:
                server.stop()
            if not summary.get("passed"):
                print((work_dir / "schemathesis.out").read_text()[-5000:], file=sys.stderr)
                if server is not None:
                    print(server.log_path.read_text()[-5000:], file=sys.stderr)
    print(f"{summary['requests']} requests in {summary['wall_s']} s: {summary['by_status']}; "
          f"5xx {summary['num_server_errors']}, stream errors {summary['num_stream_errors']}, "
          f"unanswered {summary['num_no_answer']}; /health after: {summary['health_after']}; "
          f"server alive: {summary['server_alive_after']} -> {'PASSED' if summary['passed'] else 'FAILED'} "
          f"(summary: {args.output})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
