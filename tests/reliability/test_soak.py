"""A soak in the suite (scripts/soak.py, 45 seconds): one real server under mixed streaming and
non-streaming load that keeps its small KV cache near 90% in use (requests preempted and swapped),
10% of clients hanging up part-way, greedy golden prompts among the load. It passes when no
request got a 5xx, an error event or no answer, the golden outputs never changed, the server's
RSS grew under 5% after the warm-up, every KV block came back once idle and /metrics accounts
for every request. `python scripts/soak.py` runs the same for an hour and plots it.
"""

from __future__ import annotations

import json

import pytest

from tests.scripts import load_script
from tests.serving import MODEL, ServerProcess

# 45 s of load: RSS growth is measured from the end of a 15 s warm-up, a golden round starts 4 s
# after the last one ended (at least 4 in the run), and twice the script's default 5% of clients
# hang up, so that the ~100 requests still hold several hang-ups.
DURATION, WARMUP, GOLDEN_INTERVAL, DISCONNECT_RATE = 45.0, 15.0, 4.0, 0.1
soak = load_script("soak")


@pytest.mark.slow
def test_short_soak_keeps_every_promise(default_model_path, tmp_path):
    server = ServerProcess(MODEL, *soak.SERVER_FLAGS, log_path=tmp_path / "server.log").wait_ready()
    try:
        summary = soak.soak(server.url, duration=DURATION, warmup=WARMUP, server_pid=server.proc.pid, seed=1,
                            golden_interval=GOLDEN_INTERVAL, disconnect_rate=DISCONNECT_RATE, sample_interval=1.0,
                            request_timeout=90.0)
        alive = server.proc.poll() is None
    finally:
        returncode = server.stop()
    report = json.dumps({k: v for k, v in summary.items() if k != "timeline"}, indent=1)[:20000]
    assert summary["num_failures"] == 0, report
    assert summary["golden"]["rounds"] >= 4 and not summary["golden"]["mismatches"], report
    assert summary["metrics"]["consistent"], report
    assert summary["idle_after"] and summary["health_after"] == 200, report
    assert summary["rss"]["growth"] < 0.05, report
    assert summary["passed"] and alive and returncode == 0, report
    # the run did what a soak is for: a loaded cache, preemption, hang-ups, both kinds of answer
    assert summary["kv"]["mean_usage"] > 0.6 and summary["kv"]["preemptions"] > 0, report
    assert summary["metrics"]["client_hung_up"] > 0 and summary["metrics"]["finished"]["abort"] > 0, report
    streamed = [r for r in summary["timeline"] if r["ttft_p50_s"] is not None]
    assert summary["by_outcome"]["completed"] > 50 and streamed, report
    output = tmp_path / "soak.json"
    output.write_text(json.dumps(summary))
    soak.plot(summary, output.with_suffix(".png"))
    assert output.with_suffix(".png").stat().st_size > 10_000
