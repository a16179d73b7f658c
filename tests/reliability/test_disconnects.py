"""Disconnect storms against a real server: rounds of 100 requests (streaming and not, chat and
completions, n = 1 and 2, prompts sharing prefixes) whose clients hang up at random points:
half-way through sending the body, right after sending it, while queued, during prefill,
after a few streamed events. The KV cache is small, so requests are preempted (swapped out and
recomputed) while others leave.

After each round: nothing runs or waits, the server holds no stream, every device and host KV
block is free again (exactly as many as at the start), no request ran to its max_tokens (each
would take minutes) and the server answers the next request correctly.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.serving import BASE_FLAGS, MODEL, ServerProcess
from tests.serving import scrape_metrics as metrics  # (one name for both files' many calls)

pytestmark = pytest.mark.slow

NUM_CLIENTS = 100
MAX_TOKENS = 150  # never reached: clients hang up within 1 s or HOG_EVENTS events
# The first clients of a round read this many events before they hang up: together they need more
# KV blocks than the cache has, so every round preempts (the others mostly leave too early to).
NUM_HOGS, HOG_EVENTS = 8, 16
SHARED = "Answer in one short paragraph. "
TOPICS = ["the tides", "bread", "rain", "prime numbers", "the moon", "glass", "rivers", "owls"]



def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["tokenmill_num_requests_running"] == m["tokenmill_num_requests_waiting"] == 0
                and m["tokenmill_num_requests_open"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout}s: running {m['tokenmill_num_requests_running']}, "
                                 f"waiting {m['tokenmill_num_requests_waiting']}, open {m['tokenmill_num_requests_open']}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """48 KV blocks of 4 tokens (192 tokens: about 8 requests) for 100 requests: a running request needs a new block every 4
    tokens, so requests are preempted by swap (32 host blocks) and, once the host pool is full,
    by recompute; n-gram speculation as the measured step cost plans it."""
    proc = ServerProcess(MODEL, *BASE_FLAGS, "--block-size", "4", "--num-kv-blocks", "48", "--num-host-kv-blocks", "32",
                         "--max-num-seqs", "48", "--max-waiting-requests", "1000", "--speculative-method", "ngram",
                         log_path=tmp_path_factory.mktemp("storm") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def request_body(rng: random.Random, i: int) -> tuple[str, dict]:
    topic = rng.choice(TOPICS)
    stream = rng.random() < 0.6
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": stream}
    if rng.random() < 0.2:
        body.update(n=2, temperature=0.8, seed=i)
    if rng.random() < 0.5:
        body["messages"] = [{"role": "system", "content": SHARED}, {"role": "user", "content": f"Tell me about {topic}."}]
        return "/v1/chat/completions", body
    body["prompt"] = f"{SHARED}Question {i}: what about {topic}?"
    return "/v1/completions", body


async def raw_hang_up(port: int, path: str, body: dict, fraction: float) -> str:
    """Send the request line, headers and `fraction` of the body over a socket, then close."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + payload[: int(len(payload) * fraction)])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    await writer.wait_closed()
    return "raw"


async def stream_hang_up(client: httpx.AsyncClient, url: str, body: dict, num_events: int) -> str:
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert '"error"' not in line, line
                seen += 1
                if seen >= num_events:
                    return "stream"  # leaving the block closes the unread response's connection
    raise AssertionError(f"the stream ended after {seen} events")


async def storm(url: str, port: int, rng: random.Random) -> list[str]:
    async def one(client, i):
        path, body = request_body(rng, i)
        if i < NUM_HOGS:  # first in, and they stay long enough to outgrow the cache together
            body.update(stream=True, n=1, temperature=0)
            body.pop("seed", None)
            return await stream_hang_up(client, url + path, body, HOG_EVENTS)
        await asyncio.sleep(rng.uniform(0, 0.5))  # arrivals spread over half a second
        how = rng.random()
        if how < 0.15:  # hang up while sending (or right after sending) the request
            return await raw_hang_up(port, path, body, rng.choice([0.0, 0.5, 1.0]))
        if body["stream"]:
            return await stream_hang_up(client, url + path, body, rng.randint(1, 6))
        try:  # hang up after a random time: queued, prefilling or decoding
            await asyncio.wait_for(client.post(url + path, json=body), timeout=rng.uniform(0.05, 1.0))
        except asyncio.TimeoutError:
            return "timeout"
        raise AssertionError("a request meant to run for minutes answered")

    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))


@pytest.mark.parametrize("seed", [0, 1])
def test_disconnect_storm_leaves_nothing_behind(server, seed):
    start = wait_idle(server.url)
    assert start["tokenmill_kv_cache_free_blocks"] == start["tokenmill_kv_cache_blocks"] == 48
    assert start["tokenmill_kv_cache_free_host_blocks"] == start["tokenmill_kv_cache_host_blocks"] == 32
    t0 = time.monotonic()
    kinds = asyncio.run(storm(server.url, server.port, random.Random(seed)))
    t1 = time.monotonic()
    assert len(kinds) == NUM_CLIENTS and {"raw", "stream", "timeout"} <= set(kinds)
    end = wait_idle(server.url)
    print(f"storm {seed}: clients done in {t1 - t0:.1f}s, idle {time.monotonic() - t1:.2f}s later")
    delta = lambda name: end[name] - start[name]  # noqa: E731
    assert end["tokenmill_kv_cache_free_blocks"] == 48 and end["tokenmill_kv_cache_free_host_blocks"] == 32
    assert end["tokenmill_kv_cache_usage_perc"] == 0
    # Nobody ran to max_tokens (ignore_eos: nothing stops otherwise); every request that reached
    # the engine was aborted.
    assert delta("tokenmill_request_success_total{finished_reason=length}") == 0
    assert delta("tokenmill_request_success_total{finished_reason=stop}") == 0
    aborted = delta("tokenmill_request_success_total{finished_reason=abort}")
    assert NUM_CLIENTS - kinds.count("raw") <= aborted <= NUM_CLIENTS * 2  # (n = 2: two choices)
    # every choice the engine accepted is counted once as finished (here: aborted)
    assert delta("tokenmill_request_accepted_total") == aborted
    generated = delta("tokenmill_engine_generated_tokens_total")
    assert 0 < generated < NUM_CLIENTS * MAX_TOKENS / 4
    print(f"storm {seed}: {aborted:.0f} aborted, {generated:.0f} tokens generated, "
          f"{delta('tokenmill_num_preemptions_total'):.0f} preemptions, {delta('tokenmill_swapped_out_blocks_total'):.0f} blocks swapped out")
    assert delta("tokenmill_num_preemptions_total") > 0  # the small cache was under pressure
    # The server still answers, and correctly.
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert wait_idle(server.url)["tokenmill_kv_cache_free_blocks"] == 48
