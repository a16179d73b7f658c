"""Server behaviour around the requests: /metrics, client disconnects, API keys, backpressure,
/health while loading and graceful shutdown on SIGTERM. Each test talks to a real server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serving import BASE_FLAGS, MODEL, ServerProcess
from tests.serving import scrape_metrics as metrics  # (one name for both files' many calls)

pytestmark = pytest.mark.slow



def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def small_completion(url: str, **headers) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      headers=headers, timeout=60)


def test_metrics_parse_and_counters_move(server):
    before = metrics(server.url)
    for name in ("tokenmill_time_to_first_token_seconds_count", "tokenmill_inter_token_latency_seconds_count",
                 "tokenmill_e2e_request_latency_seconds_count", "tokenmill_request_queue_time_seconds_count",
                 "tokenmill_request_prefill_time_seconds_count", "tokenmill_request_decode_time_seconds_count",
                 "tokenmill_time_per_output_token_seconds_count", "tokenmill_num_preemptions_total",
                 "tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_perc"):
        assert name in before, name
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "One two three", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    after = metrics(server.url)
    delta = lambda name: after[name] - before.get(name, 0.0)  # noqa: E731
    assert delta("tokenmill_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("tokenmill_generation_tokens_total") == 5
    assert delta("tokenmill_request_success_total{finished_reason=length}") == 1
    assert delta("tokenmill_request_success_total{finished_reason=stop}") == 0
    assert delta("tokenmill_time_to_first_token_seconds_count") == 1
    assert delta("tokenmill_inter_token_latency_seconds_count") == 4
    assert delta("tokenmill_e2e_request_latency_seconds_count") == 1
    assert after["tokenmill_num_requests_running"] == 0


def test_disconnect_mid_stream_frees_the_request(server):
    before = metrics(server.url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a million."}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    # Read a few events, then drop the connection mid-stream.
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        # Keep a reference to the line iterator: a generator collected on `break` closes the
        # connection at once, and the request must still be running while we look at it.
        lines = r.iter_lines()
        for line in lines:
            events += line.startswith("data:")
            if events == 5:
                break
        running = wait_for(lambda: (m := metrics(server.url))["tokenmill_num_requests_running"] >= 1 and m,
                           what="the stream's request to show as running")
        assert running["tokenmill_kv_cache_usage_perc"] > 0
        del lines
    wait_for(lambda: metrics(server.url)["tokenmill_num_requests_running"] == 0, what="the request to be aborted")
    after = metrics(server.url)
    assert after["tokenmill_kv_cache_usage_perc"] == 0
    assert after["tokenmill_num_requests_waiting"] == 0
    assert after["tokenmill_generation_tokens_total"] == before["tokenmill_generation_tokens_total"]  # none finished
    assert after["tokenmill_request_success_total{finished_reason=abort}"] == (
        before["tokenmill_request_success_total{finished_reason=abort}"] + 1
    )
    assert small_completion(server.url).status_code == 200


def test_disconnect_before_a_non_streaming_answer_aborts_it(server):
    body = {"model": MODEL, "prompt": "Count to a million:", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    wait_for(lambda: metrics(server.url)["tokenmill_num_requests_running"] == 0, what="the request to be aborted")
    assert metrics(server.url)["tokenmill_kv_cache_usage_perc"] == 0
    assert small_completion(server.url).status_code == 200


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A second server: an API key, one running sequence at most and at most one queued request,
    suffix decoding."""
    proc = ServerProcess(MODEL, *BASE_FLAGS, "--api-key", "sekret", "--max-num-seqs", "1",
                         "--max-waiting-requests", "1", "--shutdown-timeout", "60", "--speculative-method", "suffix",
                         log_path=tmp_path_factory.mktemp("guarded") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_speculation_metrics_name_the_method_and_the_mean_acceptance_length(guarded):
    auth = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL, "prompt": "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The",
            "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200
    spec = r.json()["usage"]["speculative_decoding"]  # this request's share
    assert spec["verifications"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"] > 0
    m = metrics(guarded.url)
    drafts = m["tokenmill_spec_decode_num_drafts_total{method=suffix}"]
    accepted = m["tokenmill_spec_decode_num_accepted_tokens_total{method=suffix}"]
    assert drafts > 0 and accepted > 0
    assert m["tokenmill_spec_decode_mean_acceptance_length{method=suffix}"] == pytest.approx(1 + accepted / drafts)
    assert m["tokenmill_spec_decode_num_accepted_tokens_per_pos_total{method=suffix,position=0}"] > 0


def test_health_is_503_while_loading(guarded):
    assert guarded.saw_loading


def test_api_key(guarded):
    r = small_completion(guarded.url)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert small_completion(guarded.url, Authorization="Bearer wrong").status_code == 401
    assert small_completion(guarded.url, Authorization="Bearer sekret").status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200


def test_backpressure_429_with_retry_after(guarded):
    auth = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 60, "ignore_eos": True}
    results = []

    def post():
        results.append(httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth, timeout=120))

    running = threading.Thread(target=post)
    running.start()
    wait_for(lambda: metrics(guarded.url)["tokenmill_num_requests_running"] == 1, what="the first request to run")
    queued = threading.Thread(target=post)
    queued.start()
    wait_for(lambda: metrics(guarded.url)["tokenmill_num_requests_waiting"] == 1, what="the second to queue")
    rejected = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth, timeout=60)
    assert rejected.status_code == 429
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    running.join()
    queued.join()
    assert [r.status_code for r in results] == [200, 200]


def test_sigterm_drains_then_exits_0(guarded):
    """Last in this module: it stops the guarded server."""
    auth = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True}
    results = []
    inflight = threading.Thread(
        target=lambda: results.append(httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth, timeout=120))
    )
    inflight.start()
    wait_for(lambda: metrics(guarded.url)["tokenmill_num_requests_running"] == 1, what="the request to run")
    guarded.proc.terminate()
    wait_for(lambda: httpx.get(f"{guarded.url}/health").status_code == 503, what="/health to say draining")
    late = small_completion(guarded.url, Authorization="Bearer sekret")
    assert late.status_code == 503
    inflight.join()
    assert results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 40
    assert guarded.proc.wait(60) == 0
