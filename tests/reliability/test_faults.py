"""Faults and overload against a real server: an exception injected into the engine step, a
stalled step, and four times the load the server admits.

When the engine dies (a step raised, or one ran past --engine-step-timeout) every in-flight
request gets an error at once: a non-streaming one a 503 in OpenAI's error shape, a stream an
error event and `[DONE]`. /health answers 503, new requests get 503, and the process exits with
status 1 about DEAD_EXIT_GRACE seconds later (the server does not try to recover: a supervisor
restarts it). Overloaded, the server answers only 200 and 429 and keeps its queue and memory
bounded. Faults come from TOKENMILL_FAULT_INJECT (tokenmill/faults.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import psutil
import pytest

from tests.reliability.test_disconnects import metrics
from tests.serving import BASE_FLAGS, MODEL, ServerProcess
from tokenmill.entrypoints.openai.api_server import DEAD_EXIT_GRACE

pytestmark = pytest.mark.slow

FAULT_STEP = 12  # a few steps into the requests below: every one of them is running
NUM_CLIENTS = 6  # half streaming, half not


class HealthProbe:
    """Polls /health every 50 ms on a thread: (seconds since start, status code or None when the
    connection is refused)."""

    def __init__(self, url: str):
        self.url, self.samples, self._stop = url, [], False
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            self.samples.append((time.monotonic() - self.t0, status))
            if status is None:
                return
            time.sleep(0.05)

    def stop(self) -> list[int | None]:
        self._stop = True
        self._thread.join(10)
        return [s for _, s in self.samples]


async def one_client(url: str, i: int) -> dict:
    """A long request (it would run for minutes): its outcome and when it ended."""
    stream = i % 2 == 0
    body = {"model": MODEL, "prompt": f"Client {i} counts to a thousand: 1, 2, 3,", "max_tokens": 4000,
            "ignore_eos": True, "stream": stream}
    result = {"stream": stream, "tokens": 0}
    async with httpx.AsyncClient(timeout=60) as client:
        if not stream:
            r = await client.post(f"{url}/v1/completions", json=body)
            result.update(status=r.status_code, body=r.json(), end=time.monotonic())
            return result
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            result["status"] = r.status_code
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line[6:] != "[DONE]" and "choices" in json.loads(line[6:]):
                        result["tokens"] += 1
                        result["last_token"] = time.monotonic()
            result.update(events=events, end=time.monotonic())
    return result


def run_clients(url: str) -> list[dict]:
    async def main():
        return await asyncio.gather(*(one_client(url, i) for i in range(NUM_CLIENTS)))

    return asyncio.run(main())


def check_every_client_got_an_error(results: list[dict]) -> None:
    for r in results:
        if r["stream"]:
            assert r["status"] == 200 and r["events"][-1] == "[DONE]", r
            error = json.loads(r["events"][-2])
            assert error["error"]["type"] == "server_error" and error["error"]["code"] == 503, error
            assert "the engine stopped" in error["error"]["message"]
        else:
            assert r["status"] == 503, r
            assert r["body"]["error"]["type"] == "server_error" and "the engine stopped" in r["body"]["error"]["message"]


def start(tmp_path, fault: str, *flags: str) -> ServerProcess:
    return ServerProcess(MODEL, *BASE_FLAGS, *flags, log_path=tmp_path / "server.log",
                         env={"TOKENMILL_FAULT_INJECT": fault}).wait_ready()


def check_dies_then_exits_1(server: ServerProcess, probe: HealthProbe, results: list[dict]) -> None:
    late = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert late.status_code == 503 and "the engine stopped" in late.json()["error"]["message"]
    assert server.proc.wait(60) == 1
    gaps = [r["end"] - r["last_token"] for r in results if r.get("last_token")]
    print(f"last token -> error: {min(gaps):.2f}-{max(gaps):.2f}s; last error -> exit: "
          f"{time.monotonic() - max(r['end'] for r in results):.2f}s")
    statuses = probe.stop()
    # 200 while serving, then 503 while dead, then the process is gone: no other answer.
    assert statuses[0] == 200 and statuses[-1] is None
    first_503 = statuses.index(503)
    assert set(statuses[:first_503]) == {200} and set(statuses[first_503:-1]) == {503}
    assert statuses.count(503) >= 5  # the grace period is observable by a probe


def test_an_exception_in_the_step_fails_every_request_then_exits_1(tmp_path):
    server = start(tmp_path, f"raise@step={FAULT_STEP}")
    try:
        probe = HealthProbe(server.url)
        results = run_clients(server.url)
        check_every_client_got_an_error(results)  # errors, not 4000 tokens each
        assert any(r.get("tokens") for r in results)  # the streams had started
        check_dies_then_exits_1(server, probe, results)
        assert "InjectedFault: injected fault at engine step 12" in server.log()
    finally:
        server.stop()


def test_a_stalled_step_fails_every_request_within_the_step_timeout_then_exits_1(tmp_path):
    timeout = 5.0
    server = start(tmp_path, f"stall@step={FAULT_STEP}:seconds=600", "--engine-step-timeout", str(timeout))
    try:
        probe = HealthProbe(server.url)
        # A first step can take seconds on a loaded host (lazy initialization): get it done
        # before the clients, so that only the injected stall outlasts the timeout.
        warm = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert warm.status_code == 200
        results = run_clients(server.url)
        check_every_client_got_an_error(results)
        for r in results:
            if r.get("last_token"):
                # the stall began after the last token arrived: the error came within the timeout
                # (plus the watchdog's 0.25 s period and scheduling slack), not after 600 s
                assert r["end"] - r["last_token"] < timeout + 5, r
        check_dies_then_exits_1(server, probe, results)
        assert "an engine step has run for more than 5s" in server.log()
    finally:
        server.stop()


def test_four_times_capacity_gets_only_200_and_429_with_bounded_queue_and_memory(tmp_path):
    """At most 4 running and 4 queued; 32 clients at once, two rounds. Then SIGTERM with a
    stream still running past --shutdown-timeout: the stream ends with an error event, exit 0."""
    server = ServerProcess(MODEL, *BASE_FLAGS, "--max-num-seqs", "4", "--max-waiting-requests", "4",
                           "--shutdown-timeout", "1", log_path=tmp_path / "server.log").wait_ready()
    try:
        process = psutil.Process(server.proc.pid)
        peak_waiting = 0
        done = threading.Event()

        def watch():
            nonlocal peak_waiting
            while not done.wait(0.02):
                peak_waiting = max(peak_waiting, metrics(server.url)["tokenmill_num_requests_waiting"])

        async def client(c: httpx.AsyncClient, i: int) -> int:
            body = {"model": MODEL, "prompt": f"Overload {i}: tell me a story.", "max_tokens": 16,
                    "ignore_eos": True, "stream": i % 2 == 0}
            if not body["stream"]:
                return (await c.post(f"{server.url}/v1/completions", json=body)).status_code
            async with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
                if r.status_code == 200:
                    assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
                return r.status_code

        async def burst():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
                return await asyncio.gather(*(client(c, i) for i in range(32)))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        statuses, rss = [], []
        try:
            for _ in range(2):
                statuses += asyncio.run(burst())
                rss.append(process.memory_info().rss)
        finally:
            done.set()
            watcher.join()
        print(f"overload: {statuses.count(200)} x 200, {statuses.count(429)} x 429, peak waiting {peak_waiting:.0f}, "
              f"RSS {[f'{b / 2**20:.0f} MiB' for b in rss]}")
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        # A burst queues before the engine admits any of it: at least the queue's 4 per round get in.
        assert statuses.count(200) >= 2 * 4 and statuses.count(429) > 0
        assert peak_waiting <= 4
        assert rss[1] - rss[0] < 64 * 2**20, rss  # no growth with the number of requests served
        m = metrics(server.url)
        assert m["tokenmill_num_requests_running"] == 0 and m["tokenmill_num_requests_open"] == 0
        assert m["tokenmill_kv_cache_free_blocks"] == m["tokenmill_kv_cache_blocks"]

        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            t0 = time.monotonic()
            server.proc.terminate()
            rest = [line for line in lines if line]
        error = json.loads(rest[-2][6:])
        assert rest[-1] == "data: [DONE]" and error["error"]["code"] == 503
        assert error["error"]["message"] == "the server is shutting down"
        assert server.proc.wait(30) == 0
        print(f"SIGTERM with a stream running: error event after {time.monotonic() - t0:.2f}s, exit 0")
    finally:
        server.stop()
