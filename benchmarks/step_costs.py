#!/usr/bin/env python
"""Step costs for `tokenmill bench simulate`: time real engine steps at a few batch shapes and fit

    t = a + b * prefill_tokens + c * decode_seqs + d * decode_context_tokens

by least squares on each step's relative error (a term that comes out negative is set to 0 and
the others refit, so that no step costs less than nothing). One `LLM` in this process, driven step by step
(`engine.add_request`, `engine.step`): every `engine.step()` is timed and its shape is read from
the scheduler's output with `tokenmill.bench.simulate.step_shape`, the simulator's own count, so
every step is a sample: one prompt of each `--prefill-lens` (max_tokens 1: a prefill-only step,
twice each), then for each `--batch-sizes` x `--context-lens`, that many requests of that many
prompt tokens decoding `--decode-steps` tokens (their chunked prefills and mixed steps
included). Prompts are random token ids and prefix caching is off, so nothing comes from the
cache; a short round first warms the engine up (not timed).

Writes the JSON `tokenmill bench simulate --step-costs` reads: the coefficients, the replica this
engine ran (KV blocks, host blocks, budgets, max_model_len), the fit's error and every sample.
The other processes' CPU use during the run is reported: a fit taken on a busy machine is off.

    python benchmarks/step_costs.py                  # the default model: well under a minute on 2 cores
    tokenmill bench simulate --step-costs benchmarks/results/step_costs.json --request-rate 2
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR, OtherLoad, add_model_args, benchmark_model, busy_warning, print_table, resolve_device, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "step_costs.json"
TERMS = ("a", "b", "c", "d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import DTYPES, QUANTIZATION_CHOICES, EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(description="Fit tokenmill bench simulate's step-cost model on this machine.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p, d.model)
    p.add_argument("--device", default="auto", help="engine device (auto: a GPU when there is one)")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="compute dtype")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="weight quantization (default: none; 'auto': a GGUF file's own formats)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the physical cores)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
    p.add_argument("--prefill-lens", default="64,256,1024", help="prompt lengths of the prefill-only steps")
    p.add_argument("--batch-sizes", default="1,4,16", help="requests decoding together")
    p.add_argument("--context-lens", default="32,256", help="prompt tokens of the decoding requests")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens each decoding request produces")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json", help="where to write the fit")
    args = p.parse_args(argv)
    for name in ("prefill_lens", "batch_sizes", "context_lens"):
        try:
            values = [int(v) for v in getattr(args, name).split(",") if v.strip()]
        except ValueError:
            p.error(f"--{name.replace('_', '-')}: expected comma-separated integers")
        if not values or min(values) < 1:
            p.error(f"--{name.replace('_', '-')}: each value must be >= 1")
        setattr(args, name, values)
    if max(args.batch_sizes) > args.max_num_seqs:
        p.error(f"--batch-sizes {max(args.batch_sizes)} exceeds --max-num-seqs {args.max_num_seqs}")
    if args.decode_steps < 2:
        p.error("--decode-steps must be >= 2")
    return args


def run_round(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[dict]:
    """Run the prompts to completion, one sample per engine step: its shape and its seconds."""
    from tokenmill import SamplingParams
    from tokenmill.bench.simulate import step_shape

    scheduler = engine.core.scheduler
    schedule = scheduler.schedule
    shapes = []

    def schedule_and_record():
        sched = schedule()
        shapes.append(step_shape(sched, scheduler.requests))  # before update() moves the requests on
        return sched

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    samples = []
    scheduler.schedule = schedule_and_record  # an instance attribute, this script only: removed below
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            shape = shapes.pop()
            samples.append({"prefill_tokens": shape.prefill_tokens, "decode_seqs": shape.decode_seqs,
                            "decode_context_tokens": shape.decode_context_tokens, "seconds": seconds})
    finally:
        del scheduler.schedule
    return samples


def fit(samples: list[dict]) -> tuple[dict[str, float], dict]:
    """Least squares on relative errors (a 5 ms decode step counts as much as a 500 ms prefill),
    every coefficient >= 0: the most negative term is dropped and the rest refit until none is
    negative. Returns the coefficients and the fit's errors."""
    import numpy as np

    x = np.array([[1.0, s["prefill_tokens"], s["decode_seqs"], s["decode_context_tokens"]] for s in samples])
    y = np.array([s["seconds"] for s in samples])
    active = list(range(len(TERMS)))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active] / y[:, None], np.ones_like(y), rcond=None)
        if solution.min() >= 0:
            break
        active.pop(int(solution.argmin()))
    coefficients = dict.fromkeys(TERMS, 0.0)
    for column, value in zip(active, solution):
        coefficients[TERMS[column]] = float(value)
    predicted = x @ np.array([coefficients[t] for t in TERMS])
    relative = np.abs(predicted - y) / y
    errors = {"num_samples": len(samples), "rms_error_s": float(np.sqrt(np.mean((predicted - y) ** 2))),
              "median_relative_error": float(np.median(relative)), "max_relative_error": float(relative.max()),
              "dropped_terms": [t for i, t in enumerate(TERMS) if i not in active]}
    return coefficients, errors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tokenmill import LLM

    device = resolve_device(args.device)
    engine_kwargs = {"device": device, "dtype": args.dtype, "quantization": args.quantization,
                     "num_threads": args.num_threads, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False}
    llm = LLM(benchmark_model(args, device), **engine_kwargs)
    engine = llm.engine
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(engine.vocab_size) for _ in range(n)]  # noqa: E731

    run_round(engine, [prompt(32) for _ in range(4)], 4, "warm")
    other = OtherLoad()
    t0 = time.perf_counter()
    samples = []
    for n in args.prefill_lens:
        for repeat in range(2):
            samples += run_round(engine, [prompt(n)], 1, f"prefill-{n}-{repeat}")
    for batch in args.batch_sizes:
        for context in args.context_lens:
            samples += run_round(engine, [prompt(context) for _ in range(batch)], args.decode_steps,
                                 f"decode-{batch}-{context}")
    seconds, other_cores = time.perf_counter() - t0, other.cores()
    coefficients, errors = fit(samples)

    core = engine.core
    replica = {"num_kv_blocks": core.runner.num_blocks, "block_size": engine.config.block_size,
               "num_host_blocks": core.runner.num_host_blocks, "max_num_batched_tokens": args.max_num_batched_tokens,
               "max_num_seqs": args.max_num_seqs, "max_model_len": core.max_model_len}
    c = coefficients
    print(f"{len(samples)} steps timed in {seconds:.1f} s; model {engine.model_path.name} on {core.device} "
          f"({core.dtype})")
    print(f"step = {c['a'] * 1e3:.3f} ms + {c['b'] * 1e6:.2f} us x prefill tokens + {c['c'] * 1e6:.2f} us x decodes "
          f"+ {c['d'] * 1e9:.2f} ns x decode context tokens")
    print(f"fit: median error {errors['median_relative_error']:.1%}, max {errors['max_relative_error']:.1%}"
          + (f"; dropped (negative): {', '.join(errors['dropped_terms'])}" if errors["dropped_terms"] else ""))
    rows = []
    for s in samples[:: max(1, len(samples) // 12)]:
        terms = (1, s["prefill_tokens"], s["decode_seqs"], s["decode_context_tokens"])
        model_s = sum(c[t] * v for t, v in zip(TERMS, terms))
        rows.append([str(s["prefill_tokens"]), str(s["decode_seqs"]), str(s["decode_context_tokens"]),
                     f"{s['seconds'] * 1e3:.2f}", f"{model_s * 1e3:.2f}"])
    print_table(["prefill tokens", "decodes", "context tokens", "measured ms", "model ms"], rows, left=0)
    warning = busy_warning({"the timed steps": other_cores})
    if warning:
        print(warning)

    from tokenmill.bench.simulate import STEP_COSTS_KIND

    config = {"model": str(engine.model_path), "engine": engine_kwargs, "prefill_lens": args.prefill_lens,
              "batch_sizes": args.batch_sizes, "context_lens": args.context_lens, "decode_steps": args.decode_steps}
    write_report(args.output, "step_costs", config=config, results=samples, kind=STEP_COSTS_KIND,
                 coefficients=coefficients, replica=replica, fit=errors, other_processes_cores=other_cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
