"""`tokenmill bench serve` against a real tokenmill server on 127.0.0.1 (small workloads: the
machine has 2 shared cores). The JSON must add up: counts, TTFT <= E2E, one ITL sample per output
token after the first, ordered percentiles, goodput <= throughput, token counts from usage."""

from __future__ import annotations

import json

import httpx
import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.slow

PCTS = ("p50", "p90", "p99")


def _run(server, tmp_path, capsys, *flags: str) -> dict:
    out_file = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.url, "--no-progress", "--request-timeout", "300",
                 "--output", str(out_file), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "latency (ms)" in out and "TTFT" in out
    return json.loads(out_file.read_text())


def _check_consistent(result: dict, num_requests: int) -> None:
    s = result["summary"]
    reqs = result["requests"]
    assert s["num_sent"] == len(reqs) == num_requests
    assert s["completed"] + s["failed"] == s["num_sent"]
    assert s["failed"] == 0, s["errors"]
    assert s["usage_reported"] and all(r["usage_reported"] for r in reqs)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs) > 0
    for r in reqs:
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert 1 <= r["output_tokens"] <= r["max_tokens"]
        # tokenmill streams one event per engine iteration, one token per iteration without speculation
        assert len(r["itl_s"]) == r["output_tokens"] - 1
        assert r["num_output_events"] == r["output_tokens"]
        assert all(gap >= 0 for gap in r["itl_s"])
        assert sum(r["itl_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-9
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[key]
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
        assert d["min"] <= d["mean"] <= d["max"]
    assert s["itl_ms"]["count"] == sum(r["output_tokens"] - 1 for r in reqs)
    assert s["slo"]["goodput"] <= s["request_throughput"]
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])


def test_random_completions_at_fixed_concurrency(server, tmp_path, capsys):
    result = _run(server, tmp_path, capsys, "--dataset", "random", "--num-requests", "8", "--input-len", "16:48",
                  "--output-len", "4:8", "--concurrency", "4", "--slo", "ttft_p99=20s,tpot=2s",
                  "--cost-per-hour", "3.6")
    _check_consistent(result, 8)
    assert result["config"]["api"] == "completions" and result["config"]["model"] == "smollm2-135m"
    assert result["load"] == "concurrency 4"
    reqs = result["requests"]
    assert all(r["output_tokens"] == r["max_tokens"] and r["finish_reason"] == "length" for r in reqs)  # EOS ignored
    # prompts were cut to their drawn lengths with the server's tokenizer (+ at most a BOS and a merge at the edges)
    assert all(14 <= r["prompt_tokens"] <= 50 for r in reqs)
    s = result["summary"]
    assert s["cost"]["run_cost"] == pytest.approx(3.6 * s["duration_s"] / 3600)
    assert s["cost"]["per_request"] == pytest.approx(s["cost"]["run_cost"] / 8)
    assert len(s["slo"]["checks"]) == 2 and s["slo"]["good_requests"] <= 8


def test_shared_prefix_chat_with_poisson_arrivals(server, tmp_path, capsys):
    result = _run(server, tmp_path, capsys, "--dataset", "shared-prefix", "--num-requests", "6",
                  "--num-groups", "2", "--system-prompt-len", "64", "--question-len", "8", "--output-len", "6",
                  "--request-rate", "10", "--concurrency", "3", "--seed", "1")
    _check_consistent(result, 6)
    assert result["config"]["api"] == "chat" and result["load"] == "Poisson 10 req/s, at most 3 in flight"
    reqs = sorted(result["requests"], key=lambda r: r["index"])
    assert all(r["output_tokens"] == 6 for r in reqs)
    # the chat template wraps the same system prompt: requests of one group have prompts of similar length
    assert reqs[0]["prompt_tokens"] >= 64 + 8
    scheduled = [r["scheduled_time_s"] for r in reqs]
    assert scheduled == sorted(scheduled) and scheduled[0] == 0.0 and scheduled[-1] > 0
    assert all(r["start_time_s"] >= r["scheduled_time_s"] for r in reqs)


def test_gsm8k_chat_burst_stops_at_eos_or_max_tokens(server, tmp_path, capsys):
    result = _run(server, tmp_path, capsys, "--dataset", "gsm8k", "--num-requests", "6", "--output-len", "8")
    _check_consistent(result, 6)
    assert result["load"] == "burst" and result["config"]["ignore_eos"] is None
    assert all(r["finish_reason"] in ("stop", "length") for r in result["requests"])
    # usage's prompt tokens are the server's count of the templated prompt (a default system prompt + the question)
    assert all(r["prompt_tokens"] > 20 for r in result["requests"])


def test_tokenize_endpoint_is_what_random_prompts_are_cut_with(server):
    from tokenmill.bench.tokenizer import ServerTokenizer

    tok = ServerTokenizer(server.url, {})
    try:
        ids = tok.encode("The quick brown fox jumps over the lazy dog.")
        assert 5 <= len(ids) <= 15
        assert tok.decode(ids) == "The quick brown fox jumps over the lazy dog."
    finally:
        tok.close()
    assert httpx.get(f"{server.url}/health").status_code == 200
