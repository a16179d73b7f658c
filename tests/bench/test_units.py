"""`tokenmill bench` pieces without a server: token accounting of streams, metrics, SLOs, cost,
arrival schedules, datasets, config validation, and that every flag is documented."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest

from tokenmill.bench.benchmark import BenchConfig, BenchError
from tokenmill.bench.client import RequestResult, TokenEvents, build_body, event_tokens
from tokenmill.bench.datasets import BenchRequest, DatasetConfig, DatasetError, LengthSpec, build_requests
from tokenmill.bench.load import LoadError, LoadPattern, arrival_times, run_load
from tokenmill.bench.metrics import SLO, MetricsError, parse_duration, parse_percentiles, parse_slos, summarize
from tokenmill.bench.plot import pareto_front

REPO = Path(__file__).resolve().parents[2]


# -- stream token accounting ---------------------------------------------------------------------


def test_one_token_per_event_gives_the_gaps_between_events():
    ev = TokenEvents()
    for t in (0.5, 0.6, 0.8, 0.9):
        ev.add(t, 1)
    first, itl, total = ev.finalize(4)
    assert first == 0.5 and total == 4
    assert itl == pytest.approx([0.1, 0.2, 0.1])


def test_an_event_with_several_tokens_spreads_its_gap_over_them():
    ev = TokenEvents()
    ev.add(1.0, 2)  # the first event's second token arrived with the first: gap 0
    ev.add(1.3, 3)
    first, itl, total = ev.finalize(None)
    assert (first, total) == (1.0, 5)
    assert itl == pytest.approx([0.0, 0.1, 0.1, 0.1])


def test_usage_tokens_beyond_the_events_are_credited_to_the_last_event():
    ev = TokenEvents()
    ev.add(0.2, 0)  # the role-only opening event carries nothing
    ev.add(0.3, 1)
    ev.add(0.5, 1)
    ev.add(0.9, 0)  # a text-less finish event: the EOS token, counted in usage
    first, itl, total = ev.finalize(3)
    assert (first, total) == (0.3, 3)
    assert itl == pytest.approx([0.2, 0.4])
    assert len(itl) == total - 1


def test_event_classification():
    chat = lambda delta, finish=None: {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    assert event_tokens(chat({"role": "assistant", "content": ""}), chat=True) == (0, None)
    assert event_tokens(chat({"content": "hi"}), chat=True) == (1, None)
    assert event_tokens(chat({"reasoning_content": "hm"}), chat=True) == (1, None)
    assert event_tokens(chat({}), chat=True) == (1, None)  # held-back text: still a token
    assert event_tokens(chat({}, "stop"), chat=True) == (0, "stop")
    assert event_tokens(chat({"content": "."}, "length"), chat=True) == (1, "length")
    assert event_tokens({"choices": [], "usage": {"completion_tokens": 3}}, chat=True) is None
    cmpl = lambda text, finish=None: {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    assert event_tokens(cmpl("a"), chat=False) == (1, None)
    assert event_tokens(cmpl(""), chat=False) == (1, None)
    assert event_tokens(cmpl("", "stop"), chat=False) == (0, "stop")


def test_request_body():
    req = BenchRequest(prompt="hello", max_tokens=5, ignore_eos=True)
    body = build_body(req, "chat", "m", 0.0, {"top_p": 0.5})
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hello"}],
                    "ignore_eos": True, "top_p": 0.5}
    body = build_body(BenchRequest(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
                      "completions", "m", 0.7, {})
    assert body["prompt"] == "a\n\nb" and "ignore_eos" not in body and body["temperature"] == 0.7


# -- metrics ---------------------------------------------------------------------------------------


def _ok(index, ttft, e2e, n, prompt=10):
    itl = [(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else []
    return RequestResult(index=index, success=True, ttft=ttft, e2e=e2e, itl=itl, prompt_tokens=prompt,
                         output_tokens=n, usage_reported=True)


def test_summary_counts_throughput_goodput_and_cost():
    results = [_ok(0, 0.1, 1.1, 11), _ok(1, 0.2, 2.2, 11), _ok(2, 2.0, 3.0, 6),
               RequestResult(index=3, error="HTTP 500: boom"), RequestResult(index=4, error="HTTP 500: boom")]
    s = summarize(results, duration=4.0, slos=parse_slos("ttft_p99=1s,tpot=150ms"), cost_per_hour=36.0)
    assert (s["num_sent"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["errors"] == {"HTTP 500: boom": 2}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 28)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["requests_per_min"] == pytest.approx(45.0)
    assert s["output_throughput"] == pytest.approx(7.0)
    assert s["total_token_throughput"] == pytest.approx(14.5)
    # TPOTs: 100 ms, 200 ms, 200 ms. Request 0 is within both SLOs; request 1 misses TPOT; 2 misses TTFT.
    assert s["tpot_ms"]["mean"] == pytest.approx(500 / 3)
    assert s["slo"]["good_requests"] == 1
    assert s["slo"]["goodput"] == pytest.approx(0.25)
    assert s["slo"]["attainment"] == pytest.approx(0.2)
    assert not s["slo"]["met"]
    assert s["itl_ms"]["count"] == 10 + 10 + 5
    # cost: 36/h for 4 s = 0.04, over 3 requests and 28 output tokens
    assert s["cost"]["run_cost"] == pytest.approx(0.04)
    assert s["cost"]["per_request"] == pytest.approx(0.04 / 3)
    assert s["cost"]["per_million_output_tokens"] == pytest.approx(0.04 / 28 * 1e6)


def test_summary_gives_the_acceptance_of_speculating_servers():
    from tokenmill.bench.report import format_summary

    plain = summarize([_ok(0, 0.1, 1.1, 11)], duration=2.0)
    assert "speculative" not in plain
    tm = [_ok(i, 0.1, 1.1, 11) for i in range(2)]
    tm[0].draft_tokens, tm[0].accepted_tokens, tm[0].verifications = 12, 9, 4
    tm[1].draft_tokens, tm[1].accepted_tokens, tm[1].verifications = 8, 3, 4
    sp = summarize(tm, duration=2.0)["speculative"]
    assert (sp["draft_tokens"], sp["accepted_tokens"], sp["verifications"]) == (20, 12, 8)
    assert sp["acceptance_rate"] == pytest.approx(0.6)
    assert sp["mean_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert any("12 of 20 drafts accepted (60.0%), mean acceptance length 2.50" in line
               for line in format_summary(summarize(tm, duration=2.0)))
    # llama-server's timings give no verification count: the rate, not the length
    llama = [_ok(0, 0.1, 1.1, 11)]
    llama[0].draft_tokens, llama[0].accepted_tokens = 10, 4
    sp = summarize(llama, duration=2.0)["speculative"]
    assert sp["acceptance_rate"] == pytest.approx(0.4) and sp["mean_acceptance_length"] is None


def test_slo_run_check_uses_the_given_percentile_or_every_request():
    results = [_ok(i, 0.1, 1.0, 10) for i in range(99)] + [_ok(99, 5.0, 5.5, 10)]
    s = summarize(results, 10.0, parse_percentiles("50,90,99"), parse_slos("ttft_p90=1s"))
    assert s["slo"]["met"] and s["slo"]["good_requests"] == 99
    assert s["slo"]["checks"][0]["value_ms"] == pytest.approx(100.0)
    s = summarize(results, 10.0, slos=parse_slos("ttft=1s"))  # every request: the outlier fails the run
    assert not s["slo"]["met"] and s["slo"]["checks"][0]["value_ms"] == pytest.approx(5000.0)
    s = summarize(results, 10.0, slos=parse_slos("itl=101ms"))  # ITL gaps are 100 ms and 56 ms
    assert s["slo"]["met"] and s["slo"]["good_requests"] == 100
    s = summarize(results, 10.0)  # no SLOs: goodput = throughput
    assert s["slo"]["goodput"] == s["request_throughput"] and not s["slo"]["met"]


def test_percentiles_are_ordered_and_exact():
    results = [_ok(i, ttft=(i + 1) / 100, e2e=1.0, n=2) for i in range(100)]
    d = summarize(results, 1.0)["ttft_ms"]
    assert d["min"] == pytest.approx(10) and d["max"] == pytest.approx(1000)
    assert d["p50"] == pytest.approx(505) and d["p90"] == pytest.approx(901) and d["p99"] == pytest.approx(990.1)
    assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]


def test_empty_run_summary():
    s = summarize([RequestResult(index=0, error="x")], 1.0, slos=parse_slos("e2e=1s"), cost_per_hour=1.0)
    assert s["completed"] == 0 and s["ttft_ms"]["p99"] is None and s["ttft_ms"]["count"] == 0
    assert s["cost"]["per_request"] is None and not s["slo"]["met"]


def test_parsing_slos_durations_and_percentiles():
    assert parse_duration("1s") == 1.0 and parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("0.25") == 0.25 and parse_duration("200us") == pytest.approx(2e-4)
    assert parse_duration("2m") == 120.0
    assert parse_slos("ttft_p99=1s,tpot=50ms") == [SLO("ttft", 1.0, 99.0), SLO("tpot", 0.05, None)]
    assert parse_slos("e2e_p99.9=3s") == [SLO("e2e", 3.0, 99.9)]
    assert parse_percentiles("99,50,90") == (50.0, 90.0, 99.0)
    for bad in ("ttft", "latency=1s", "ttft=fast", "ttft_p0=1s", "tpot=-1ms"):
        with pytest.raises(MetricsError):
            parse_slos(bad)
    with pytest.raises(MetricsError, match="percentiles"):
        parse_percentiles("50,101")


# -- load ------------------------------------------------------------------------------------------


def test_arrivals():
    assert arrival_times(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    times = arrival_times(4000, 5.0, random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)  # exponential gaps, mean 1/rate
    assert LoadPattern().kind == "burst"
    assert LoadPattern(max_concurrency=4).describe() == "concurrency 4"
    assert LoadPattern(request_rate=2.0, max_concurrency=3).describe() == "Poisson 2 req/s, at most 3 in flight"
    for bad in ({"request_rate": 0.0}, {"max_concurrency": 0}, {"duration": -1.0}):
        with pytest.raises(LoadError):
            LoadPattern(**bad)


def _drive(pattern: LoadPattern, num_requests: int, work_s: float = 0.02) -> tuple[list[RequestResult], float, int]:
    """run_load with a fake send that takes `work_s`; returns the results, duration and most in flight."""
    import asyncio

    in_flight, most = 0, 0

    async def send(index: int, scheduled: float, origin: float) -> RequestResult:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(work_s)
        in_flight -= 1
        return RequestResult(index=index, success=True, scheduled_time=scheduled)

    results, duration = asyncio.run(run_load(pattern, num_requests, send, seed=0))
    return results, duration, most


def test_load_concurrency_cap_burst_and_time_bound():
    results, _, most = _drive(LoadPattern(max_concurrency=3), 12)
    assert [r.index for r in results] == list(range(12)) and most == 3
    results, _, most = _drive(LoadPattern(), 12)  # a burst: everything in flight at once
    assert len(results) == 12 and most == 12
    results, duration, most = _drive(LoadPattern(request_rate=50.0, max_concurrency=2), 40)
    assert len(results) == 40 and most <= 2
    assert [r.scheduled_time for r in results] == arrival_times(40, 50.0, random.Random(0))
    # bounded in time: nothing is sent after `duration`, what was sent finishes, the run stops by itself
    # (no lower bound on the count: on a loaded machine the loop may start after the window)
    results, duration, _ = _drive(LoadPattern(max_concurrency=1, duration=0.2), 1000, work_s=0.05)
    assert len(results) <= 5 and all(r.success for r in results) and 0.2 <= duration < 5.0


# -- datasets --------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character: prompt lengths can be checked exactly."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(i) for i in token_ids)


def test_length_specs():
    rng = random.Random(0)
    assert LengthSpec.parse("7").sample(rng, 3) == [7, 7, 7]
    assert all(3 <= n <= 5 for n in LengthSpec.parse("3:5").sample(rng, 50))
    assert set(LengthSpec.parse("3:5").sample(rng, 200)) == {3, 4, 5}
    assert all(n >= 1 for n in LengthSpec.parse("normal:4:10").sample(rng, 200))
    assert str(LengthSpec.parse("exp:32")) == "exp:32"
    for bad in ("0", "5:3", "x", "normal:3", "1:2:3"):
        with pytest.raises(DatasetError):
            LengthSpec.parse(bad)


def test_random_dataset_has_the_drawn_lengths_and_is_deterministic():
    cfg = DatasetConfig("random", num_requests=20, input_len="5:40", output_len="3:9", seed=3)
    reqs = build_requests(cfg, CharTokenizer())
    assert all(len(r.prompt) == r.target_input_len and 5 <= r.target_input_len <= 40 for r in reqs)
    assert all(3 <= r.max_tokens <= 9 and r.ignore_eos for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    assert [r.prompt for r in build_requests(cfg, CharTokenizer())] == [r.prompt for r in reqs]
    cfg = DatasetConfig("random", num_requests=2, input_len="4", ignore_eos=False)
    assert not any(r.ignore_eos for r in build_requests(cfg, CharTokenizer()))


def test_shared_prefix_dataset_groups_share_the_system_prompt():
    cfg = DatasetConfig("shared-prefix", num_requests=9, num_groups=3, system_prompt_len=50, question_len="6")
    reqs = build_requests(cfg, CharTokenizer())
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 3 and all(len(s) == 50 for s in systems)
    assert systems[0] == systems[3] == systems[6]
    assert [r.messages[0]["role"] for r in reqs] == ["system"] * 9
    assert all(len(r.messages[1]["content"]) == 6 for r in reqs) and len({r.messages[1]["content"] for r in reqs}) == 9


def test_packaged_datasets():
    gsm = build_requests(DatasetConfig("gsm8k", num_requests=5, output_len="64"))
    assert len(gsm) == 5 and all(r.messages[0]["content"].startswith("Question:") for r in gsm)
    assert all(r.max_tokens == 64 and not r.ignore_eos for r in gsm)
    code = build_requests(DatasetConfig("humaneval", num_requests=3))
    assert len(code) == 3 and all("def " in r.prompt for r in code)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = build_requests(DatasetConfig("jsonl", num_requests=4, path=str(path), output_len="9"))
    assert sorted((r.prompt or r.messages[0]["content"], r.max_tokens) for r in reqs) == [
        ("hello", 9), ("hello", 9), ("hi", 3), ("hi", 3)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(DatasetError, match="mine.jsonl:1"):
        build_requests(DatasetConfig("jsonl", num_requests=1, path=str(path)))
    with pytest.raises(DatasetError, match="--dataset-path"):
        DatasetConfig("jsonl")


def test_config_validation():
    assert BenchConfig(base_url="http://h:1/v1/").root_url == "http://h:1"
    assert BenchConfig(api_key="secret").to_json()["api_key"] == "<set>"
    for bad, field in (({"api": "grpc"}, "api"), ({"base_url": "localhost:8000"}, "base_url"),
                       ({"request_timeout": 0}, "request_timeout"), ({"slo": "ttft=1x"}, "duration"),
                       ({"input_len": "a:b"}, "length spec"), ({"concurrency": 0}, "concurrency")):
        with pytest.raises(ValueError, match=field):
            BenchConfig(**bad)
    assert issubclass(BenchError, ValueError)


def test_pareto_front():
    points = [(10, 100), (20, 150), (15, 200), (30, 400), (25, 500), (30, 450)]
    assert pareto_front(points) == [0, 1, 3]


# -- documentation ---------------------------------------------------------------------------------


def test_every_bench_flag_is_in_the_help_and_the_cli_reference():
    from tokenmill.cli import build_parser

    reference = (REPO / "docs" / "cli.md").read_text()
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    commands = bench._subparsers._group_actions[0].choices
    assert set(commands) == {"serve", "sweep", "plot", "simulate"}
    for name, parser in commands.items():
        section = reference[reference.index(f"## tokenmill bench {name}\n"):]
        section = section[:section.index("\n## ")] if "\n## " in section else section
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"bench {name} {action.option_strings} has no help"
            assert any(re.search(re.escape(o) + r"\b", section) for o in action.option_strings), \
                f"docs/cli.md does not document bench {name} {action.option_strings}"
