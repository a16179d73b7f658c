"""`tokenmill bench simulate`: the engine's scheduler driven on a simulated clock, against one and
two replicas; exact timings from a cost model, conservation of tokens, traces, the command."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.simulate import (
    ReplicaSpec, SimConfig, SimulationError, StepCosts, TraceRequest, load_step_costs, read_trace, run_simulation,
    simulate, synthetic_trace, write_trace,
)


def test_one_request_with_only_a_per_step_cost_has_ttft_and_itl_equal_to_it():
    a = 0.375  # a binary fraction: the step ends (a, 2a, ...) and their gaps are exact
    sim = simulate([TraceRequest(2.0, 40, 5)], StepCosts(a=a))
    (r,) = sim.results
    assert r.success and r.finish_reason == "length"
    assert r.ttft == a and r.itl == [a] * 4 and r.e2e == 5 * a
    assert sim.duration == 5 * a  # from the arrival at 2.0, not from 0
    assert sim.replicas[0]["num_steps"] == 5


def test_step_time_follows_the_cost_model_terms():
    # budget 16: a 40-token prompt is three prefill chunks (16, 16, 8), then one decode per token
    costs = StepCosts(a=0.5, b=0.25, c=2.0, d=0.125)
    sim = simulate([TraceRequest(0.0, 40, 3)], costs, ReplicaSpec(max_num_batched_tokens=16))
    (r,) = sim.results
    prefill = 3 * 0.5 + 40 * 0.25
    assert r.ttft == prefill
    # the decodes attend to 41 and then 42 keys (prompt + outputs so far, the new token included)
    assert r.itl == [0.5 + 2.0 + 41 * 0.125, 0.5 + 2.0 + 42 * 0.125]


def test_requests_arriving_together_share_steps():
    sim = simulate([TraceRequest(0.0, 8, 4), TraceRequest(0.0, 8, 4)], StepCosts(a=1.0))
    assert [r.ttft for r in sim.results] == [1.0, 1.0]
    assert sim.replicas[0]["num_steps"] == 4


def test_a_request_arriving_mid_step_waits_for_the_next():
    sim = simulate([TraceRequest(0.0, 8, 4), TraceRequest(0.5, 8, 2)], StepCosts(a=1.0))
    first, second = sim.results
    assert first.itl == [1.0, 1.0, 1.0]
    assert second.ttft == 1.5  # joins the step that starts at 1.0 and ends at 2.0


def test_two_replicas_cut_queueing_under_a_load_one_cannot_keep_up_with():
    # one replica decodes at most 1 / c = 250 tokens/s, about 7 requests/s of 32 tokens: 10/s overloads it
    trace = synthetic_trace(200, 10.0, "64", "32", seed=1)
    costs = StepCosts(a=0.01, b=1e-4, c=4e-3)
    one, two = (run_simulation(SimConfig(num_replicas=n, step_a=costs.a, step_b=costs.b, step_c=costs.c), trace)
                for n in (1, 2))
    assert one["summary"]["ttft_ms"]["p99"] > 2 * two["summary"]["ttft_ms"]["p99"]
    assert one["summary"]["duration_s"] > two["summary"]["duration_s"]
    assert [r["num_requests"] for r in two["replicas"]] != [200, 0]  # both replicas took requests
    assert sum(r["num_requests"] for r in two["replicas"]) == 200


def test_every_request_finishes_with_exactly_its_output_tokens_through_preemption():
    # 16 blocks of 16 tokens per replica hold two or three requests of 20-100 + 1-60 tokens: preemption,
    # recomputed without host blocks, swapped out with them
    trace = synthetic_trace(30, 50.0, "20:100", "1:60", seed=3)
    for spec in (ReplicaSpec(num_kv_blocks=16), ReplicaSpec(num_kv_blocks=16, num_host_blocks=12)):
        sim = simulate(trace, StepCosts(a=0.01, c=1e-3), spec, num_replicas=2)
        assert sum(r["num_preemptions"] for r in sim.replicas) > 0
        for req, r in zip(trace, sim.results):
            assert r.success and r.finish_reason == "length"
            assert r.output_tokens == req.output_tokens and len(r.itl) == req.output_tokens - 1
            assert r.ttft > 0 and all(gap > 0 for gap in r.itl)
            assert r.e2e == pytest.approx(r.ttft + sum(r.itl))
    assert sum(r["num_swap_preemptions"] for r in sim.replicas) > 0


def test_a_request_that_can_never_fit_is_counted_as_failed():
    trace = [TraceRequest(0.0, 100, 10), TraceRequest(0.0, 8, 2)]
    result = run_simulation(SimConfig(step_a=0.1, num_kv_blocks=4), trace)
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (1, 1)
    assert "KV blocks" in result["requests"][0]["error"]


def test_trace_file_round_trip_replays_the_same_run(tmp_path):
    trace = synthetic_trace(20, 5.0, "normal:64:16", "exp:20", seed=7)
    path = write_trace(tmp_path / "trace.jsonl", trace)
    assert read_trace(path) == trace
    config = SimConfig(step_a=0.02, step_b=1e-4, trace=str(path))
    from_file = run_simulation(config)
    in_memory = run_simulation(SimConfig(step_a=0.02, step_b=1e-4), trace)
    assert from_file["requests"] == in_memory["requests"]


def test_bad_traces_and_step_cost_files_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"time": 0, "prompt_tokens": 4, "output_tokens": 2}\n'
                   '{"time": 1, "prompt_tokens": 0, "output_tokens": 2}\n')
    with pytest.raises(SimulationError, match="line 2.*prompt_tokens"):
        read_trace(bad)
    bad.write_text('{"time": 0, "prompt_tokens": 4, "output_tokens": 2, "extra": 1}\n')
    with pytest.raises(SimulationError, match="line 1"):
        read_trace(bad)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"coefficients": {"a": 0.01, "e": 1}}))
    with pytest.raises(SimulationError, match="unknown coefficients"):
        load_step_costs(costs)
    with pytest.raises(SimulationError, match="all 0"):
        SimConfig()
    with pytest.raises(SimulationError, match="step cost b"):
        StepCosts(a=1.0, b=-1.0)


def test_the_step_cost_file_sets_the_replica_and_flags_override_it(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"kind": "tokenmill-step-costs",
                                "coefficients": {"a": 0.01, "b": 1e-4, "c": 1e-3, "d": 0},
                                "replica": {"num_kv_blocks": 99, "max_num_seqs": 7}, "samples": []}))
    costs, replica = SimConfig(step_costs=str(path), step_c=2e-3, max_num_seqs=5).costs_and_replica
    assert costs == StepCosts(a=0.01, b=1e-4, c=2e-3, d=0)
    assert replica == ReplicaSpec(num_kv_blocks=99, max_num_seqs=5)


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys):
    from tokenmill.cli import main

    out = tmp_path / "sim.json"
    rc = main(["bench", "simulate", "--num-requests", "12", "--request-rate", "4", "--input-len", "32",
               "--output-len", "8", "--num-replicas", "2", "--step-a", "0.01", "--step-c", "0.001",
               "--cost-per-hour", "2", "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tokenmill bench simulate: 2 replicas" in text and "per 1M output tokens (at $4/h" in text
    result = json.loads(out.read_text())
    assert result["kind"] == "tokenmill-bench-simulate"
    assert result["summary"]["completed"] == 12 and result["summary"]["total_output_tokens"] == 96
    assert set(result["summary"]["ttft_ms"]) >= {"p50", "p90", "p99"}


def test_the_step_cost_fit_recovers_exact_coefficients_and_keeps_them_non_negative(monkeypatch):
    import importlib.util
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # the script imports its neighbour `common`
    spec = importlib.util.spec_from_file_location("step_costs", benchmarks / "step_costs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    shapes = [(64, 0, 0), (1024, 0, 0), (0, 1, 40), (0, 8, 3000), (0, 16, 9000), (100, 4, 500)]
    true = {"a": 2e-3, "b": 1e-5, "c": 3e-4, "d": 2e-8}
    samples = [{"prefill_tokens": p, "decode_seqs": n, "decode_context_tokens": c,
                "seconds": true["a"] + true["b"] * p + true["c"] * n + true["d"] * c} for p, n, c in shapes]
    coefficients, errors = script.fit(samples)
    assert coefficients == pytest.approx(true, rel=1e-9)
    assert errors["max_relative_error"] < 1e-9 and errors["dropped_terms"] == []
    # times that fall with the context: d would be negative, so it is dropped and the rest refit
    for s in samples:
        s["seconds"] = 0.01 + 1e-5 * s["prefill_tokens"] - 1e-7 * s["decode_context_tokens"] + 1e-3 * s["decode_seqs"]
    coefficients, errors = script.fit(samples)
    assert errors["dropped_terms"] == ["d"] and coefficients["d"] == 0
    assert min(coefficients.values()) >= 0
    StepCosts(**coefficients)  # what simulate accepts
