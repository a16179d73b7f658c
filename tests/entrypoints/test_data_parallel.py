"""`tokenmill serve --data-parallel-size 2`: the router's choices on plain block hashes, then one
real front end with two replicas of the default model, driven with the `openai` client:
completions and streams pass through, a shared system prompt stays on one replica and hits its
prefix cache, errors and disconnects reach the replica, and a replica's death ends the front end."""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import astuple
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.serving import MODEL, ServerProcess, scrape_metrics
from tokenmill.core.block_pool import hash_block
from tokenmill.engine.async_llm import EngineStats
from tokenmill.entrypoints.data_parallel import prefix_cache_blocks
from tokenmill.entrypoints.openai.metrics import _EngineCounters
from tokenmill.entrypoints.router import MAX_INDEX_BLOCKS, PrefixIndex, Router, prompt_block_hashes

# -- the router, on plain hashes -------------------------------------------------------------------


def test_prompt_block_hashes_chain_the_full_blocks_before_the_last_token():
    tokens = list(range(33))
    first = hash_block(None, tokens[:16])
    assert prompt_block_hashes(tokens, 16) == [first, hash_block(first, tokens[16:32])]
    assert prompt_block_hashes(tokens[:32], 16) == [first]  # the engine computes the last token
    assert prompt_block_hashes(tokens[:16], 16) == []


def test_prefix_index_matches_a_chain_and_forgets_the_least_recently_used():
    index = PrefixIndex(max_blocks=3)
    index.add([b"a", b"b"])
    assert index.match([b"a", b"b", b"c"]) == 2
    assert index.match([b"b"]) == 1 and index.match([b"x", b"a"]) == 0
    index.add([b"c", b"d"])  # a is the oldest
    assert len(index) == 3 and index.match([b"a", b"b"]) == 0 and index.match([b"b", b"c", b"d"]) == 3
    index.add([b"b"])  # used again: c is now the oldest
    index.add([b"e"])
    assert index.match([b"b"]) == 1 and index.match([b"c"]) == 0 and index.match([b"d", b"e"]) == 2


def test_router_prefers_the_longest_prefix_unless_its_replica_is_much_busier():
    router = Router(num_replicas=3, max_blocks_per_replica=100, load_slack=2)
    route = lambda hashes: astuple(router.choose(hashes))  # noqa: E731  (replica, reason, matched blocks)
    assert route([b"s1", b"s2", b"q1"]) == (0, "load", 0)  # all idle: the lowest index
    assert route([b"s1", b"s2", b"q2"]) == (0, "prefix", 2)  # 1 more in flight than replica 1: within the slack
    assert route([b"t1"]) == (1, "load", 0)
    assert route([b"s1"]) == (0, "prefix", 1)  # 2 more than replica 2: still within
    assert router.num_in_flight == [3, 1, 0]
    assert route([b"s1", b"s2"]) == (2, "load", 0)  # 3 more: past the slack
    for _ in range(3):
        router.finish(0)
    assert router.num_in_flight == [0, 1, 1]
    assert route([b"s1", b"s2"]) == (0, "prefix", 2)  # 0 and 2 hold it: 0 has fewer in flight
    assert route([b"s1", b"s2"]) == (2, "prefix", 2)  # equal in flight: 2 was sent fewer requests
    assert router.num_in_flight == [1, 1, 2] and router.num_routed == [4, 1, 2]


def test_router_breaks_load_ties_by_kv_cache_usage():
    router = Router(num_replicas=2, max_blocks_per_replica=10)
    router.kv_cache_usage = [0.5, 0.1]
    assert router.choose([]).replica == 1
    router.finish(1)
    router.kv_cache_usage = [0.0, 0.1]
    assert router.choose([]).replica == 0


def test_the_router_remembers_what_a_replica_s_kv_cache_host_and_disk_tiers_hold():
    def metrics(tier_capacity_blocks):
        stats = EngineStats(num_blocks=tier_capacity_blocks[0], bytes_per_block=1000,
                            tier_capacity_blocks=tier_capacity_blocks)
        registry = CollectorRegistry()
        registry.register(_EngineCounters(SimpleNamespace(stats=stats, config=SimpleNamespace(speculative_method=None)),
                                          "m"))
        gauge = f'tokenmill_kv_cache_blocks{{model_name="m"}} {float(tier_capacity_blocks[0])}\n'  # (a server gauge)
        return generate_latest(registry).decode() + gauge

    assert prefix_cache_blocks(metrics((12, 0, 0))) == 12  # the KV cache alone
    assert prefix_cache_blocks(metrics((12, 6, 100))) == 118  # + host slots + disk files
    assert prefix_cache_blocks("") == 1
    assert PrefixIndex(MAX_INDEX_BLOCKS + 1).max_blocks == MAX_INDEX_BLOCKS


# -- a real front end with two replicas -----------------------------------------------------------

FLAGS = ["--data-parallel-size", "2", "--num-threads", "2", "--kv-cache-memory-gb", "0.1", "--swap-space", "0",
         "--log-stats-interval", "0", "--shutdown-timeout", "5"]
SYSTEM = ("You answer questions about the GNU General Public License, version 3. It guarantees your freedom "
          "to share and change all versions of a program, to make sure it remains free software for all its "
          "users. When we speak of free software, we are referring to freedom, not price: you may distribute "
          "copies, receive source code or get it if you want it, change the software or use pieces of it in "
          "new free programs, and know that you can do these things.")


@pytest.fixture(scope="module")
def dp_server(default_model_path, tmp_path_factory):
    proc = ServerProcess(MODEL, *FLAGS, log_path=tmp_path_factory.mktemp("dp") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(dp_server):
    return openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def replicas(server: ServerProcess) -> dict[int, tuple[int, str]]:
    """Replica index -> (pid, url), from the front end's log."""
    found = re.findall(r"started replica (\d+) \(pid (\d+), (http://[\d.:]+)\)", server.log())
    return {int(i): (int(pid), url) for i, pid, url in found}


def per_replica(metrics: dict[str, float], name: str, **labels) -> list[float]:
    """A sample's value on replica 0 and 1 (scrape_metrics' keys: labels sorted, model_name left out)."""
    keys = [",".join(f"{k}={v}" for k, v in sorted({**labels, "replica": i}.items())) for i in range(2)]
    return [metrics.get(f"{name}{{{key}}}", 0.0) for key in keys]


def grown(after: dict[str, float], before: dict[str, float], name: str, **labels) -> list[float]:
    return [a - b for a, b in zip(per_replica(after, name, **labels), per_replica(before, name, **labels))]


@pytest.mark.slow
def test_completion_and_streamed_chat_pass_through(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                                 max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.slow
def test_a_shared_system_prompt_stays_on_one_replica_and_hits_its_prefix_cache(dp_server, client):
    before = scrape_metrics(dp_server.url)
    for question in ("What is free software?", "Can I sell copies?", "What about patents?", "Who is a licensee?"):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    after = scrape_metrics(dp_server.url)
    by_prefix = grown(after, before, "tokenmill_router_requests_routed_total", reason="prefix")
    by_load = grown(after, before, "tokenmill_router_requests_routed_total", reason="load")
    routed = [p + q for p, q in zip(by_prefix, by_load)]
    assert sorted(routed) == [0, 4], routed
    holder = routed.index(4)
    assert by_prefix[holder] == 3
    hits = grown(after, before, "tokenmill_prefix_cache_hits_total")
    assert hits[holder] >= 3 * 3 * 16, hits  # 3 repeats of a system prompt of more than 3 blocks
    assert grown(after, before, "tokenmill_prefix_cache_queries_total")[1 - holder] == 0


@pytest.mark.slow
def test_metrics_label_every_replica(dp_server):
    metrics = scrape_metrics(dp_server.url)
    for i in range(2):
        assert f"tokenmill_kv_cache_blocks{{replica={i}}}" in metrics
        assert f"tokenmill_router_requests_in_flight{{replica={i}}}" in metrics


@pytest.mark.slow
def test_a_validation_error_is_the_replicas_own(dp_server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "bogus": 1}
    through = httpx.post(f"{dp_server.url}/v1/completions", json=body, timeout=30)
    _, url = replicas(dp_server)[0]
    direct = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert through.status_code == direct.status_code == 400
    assert through.content == direct.content and through.json()["error"]["param"] == "bogus"


@pytest.mark.slow
def test_a_client_disconnect_aborts_the_replicas_request(dp_server):
    before = scrape_metrics(dp_server.url)
    body = {"model": MODEL, "prompt": "Count to a million:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dp_server.url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while sum(grown(after := scrape_metrics(dp_server.url), before, "tokenmill_request_success_total",
                    finished_reason="abort")) != 1:
        assert time.monotonic() < deadline, "the replica did not abort the request"
        time.sleep(0.1)
    assert per_replica(after, "tokenmill_num_requests_running") == [0, 0]
    assert per_replica(after, "tokenmill_router_requests_in_flight") == [0, 0]


@pytest.mark.slow
def test_the_page_is_the_front_ends_and_its_stats_stream_replica_0s_outside_the_router(dp_server):
    page = httpx.get(f"{dp_server.url}/", timeout=10)
    assert page.status_code == 200 and 'src="web/app.js"' in page.text
    assert httpx.get(f"{dp_server.url}/web/app.js", timeout=10).status_code == 200
    _, replica_0 = replicas(dp_server)[0]
    with httpx.stream("GET", f"{dp_server.url}/stats/stream", params={"interval": 0.1}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == "0 of 2"
        lines = r.iter_lines()
        event = json.loads(next(line for line in lines if line.startswith("data:")).removeprefix("data:"))
        assert event["ready"] and event["num_blocks"] == scrape_metrics(replica_0)["tokenmill_kv_cache_blocks"]
        # an open stream is no load: the router still counts nothing in flight
        assert per_replica(scrape_metrics(dp_server.url), "tokenmill_router_requests_in_flight") == [0, 0]


@pytest.mark.slow
def test_a_dead_replica_ends_the_front_end_with_an_error_naming_it(dp_server):
    """(Last: it stops the module's server.)"""
    pids = {i: pid for i, (pid, _) in replicas(dp_server).items()}
    psutil.Process(pids[1]).send_signal(signal.SIGKILL)
    assert dp_server.proc.wait(timeout=30) == 1
    log = dp_server.log()
    assert re.search(rf"replica 1 \(pid {pids[1]}, .*\) was killed by SIGKILL", log), log[-2000:]
    assert gone(pids[0])  # the other replica was stopped too


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
