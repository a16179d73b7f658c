#!/usr/bin/env python
"""Per-step engine overhead at N running requests: how much of a decode step is not the model.

tokenmill, one `LLM` in this process, driven step by step (`engine.add_request`, `engine.step`):
for each N of `--num-requests` (default 64 and 1), N requests of `--prompt-len` tokens (distinct
slices of GPL-3), `--output-len` output tokens, greedy, EOS ignored, all added at once, after a
short warm-up round of the same N. Timers are wrapped (in this script only) around
`runner.model.forward`, `runner.model.compute_logits`, `runner.sampler`, `runner.execute_model`,
`scheduler.schedule`, `scheduler.update` and `core.step`, and each `engine.step()` is timed. Only
steps in which all N requests decode (N tokens scheduled, none of them prompt tokens) count.

    step      = engine.step()
    model     = forward + compute_logits
    overhead  = step - model, split into
      schedule     scheduler.schedule
      prep         execute_model - forward - compute_logits - sampler (inputs, metadata, bookkeeping)
      sampler      runner.sampler
      update       scheduler.update
      core other   core.step - schedule - execute_model - update
      output       engine.step - core.step (detokenize, RequestOutputs)

Target: overhead <= 10% of the step at 64 running requests.

Hugging Face (`--skip-hf` to leave out): a static batch of the same N prompts through `generate`
(max_new_tokens = min_new_tokens = `--output-len`), its `forward` timed (the logits included: HF
computes them inside forward) and each step's time taken by a stopping criterion (called once per
step); decode steps only (not the first).

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --num-requests 4,1 --output-len 8   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import (
    RESULTS_DIR, TEXT_FILE, OtherLoad, busy_warning, cut_prompts, fmt, hf_generate_batch, hf_pad_id, load_hf,
    print_table, text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "step_overhead.json"
TARGET_REQUESTS = 64
TARGET_FRACTION = 0.10
PARTS = ["schedule", "prep", "sampler", "update", "core_other", "output"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import DTYPES, QUANTIZATION_CHOICES, EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="Per-step overhead of the tokenmill engine (step time minus model forward + logits) at N running "
        "decodes, with a breakdown, vs Hugging Face generate's per-step overhead at the same batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--num-requests", default=f"{TARGET_REQUESTS},1", metavar="N[,N...]",
                   help="running requests to measure at, comma-separated, each a separate round in the same engine")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (cut from the GPL-3 text)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (exact: EOS is ignored)")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="tokenmill compute dtype")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="tokenmill weight-only quantization of the linears (default: none, the dtype's weights; "
                        "'auto': a GGUF file's own formats)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokenmill: token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="tokenmill: most requests running at once")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads; None = tokenmill's default, the physical core count")
    p.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face transformers reference")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of the HF model (default: tokenmill's resolved compute dtype)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    try:
        args.num_requests = [int(n) for n in args.num_requests.split(",") if n.strip()]
    except ValueError:
        p.error(f"--num-requests: expected comma-separated integers, got {args.num_requests!r}")
    if not args.num_requests or min(args.num_requests) < 1:
        p.error("--num-requests: each N must be >= 1")
    if max(args.num_requests) > args.max_num_seqs:
        p.error(f"--num-requests {max(args.num_requests)} exceeds --max-num-seqs {args.max_num_seqs}")
    if args.prompt_len < 1 or args.output_len < 2:
        p.error("need --prompt-len >= 1 and --output-len >= 2 (at least one decode step)")
    return args


class Timers:
    """perf_counter timers wrapped around methods (instance attributes: the class is untouched),
    summed per engine step in `current`."""

    def __init__(self, sync=None):
        self.current: dict[str, float] = defaultdict(float)
        self.sync = sync  # e.g. torch.cuda.synchronize, so that a timer covers the device work
        self._restore: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name: str, on_return=None) -> None:
        original = getattr(obj, attr)
        own = vars(obj).get(attr)  # an instance attribute (e.g. runner.sampler), put back as it was

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.current[name] += time.perf_counter() - t0
            if on_return is not None:
                on_return(result)
            return result

        setattr(obj, attr, timed)
        self._restore.append((obj, attr, own))

    def unwrap(self) -> None:
        for obj, attr, own in reversed(self._restore):
            if own is None:
                delattr(obj, attr)  # the class's own method shows through again
            else:
                setattr(obj, attr, own)
        self._restore.clear()


# -- tokenmill ----------------------------------------------------------------------------------


def run_tokenmill(llm, n: int, prompts: list[list[int]], warm_prompts: list[list[int]], output_len: int) -> dict:
    import torch

    from tokenmill import SamplingParams

    engine = llm.engine
    core, runner = engine.core, engine.core.runner
    timers = Timers(torch.cuda.synchronize if core.device == "cuda" else None)
    scheduled = {}
    timers.wrap(core, "step", "core")
    timers.wrap(core.scheduler, "schedule", "schedule", on_return=lambda s: scheduled.__setitem__("last", s))
    timers.wrap(core.scheduler, "update", "update")
    timers.wrap(runner, "execute_model", "execute")
    timers.wrap(runner, "sampler", "sampler")
    timers.wrap(runner.model, "forward", "forward")
    timers.wrap(runner.model, "compute_logits", "logits")

    def round_(batch: list[list[int]], max_tokens: int, tag: str) -> tuple[list[dict], int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(batch):
            engine.add_request(f"{tag}-{n}-{i}", prompt, params)
        steps, all_steps = [], 0
        while engine.has_unfinished_requests():
            timers.current.clear()
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            all_steps += 1
            sched = scheduled["last"]
            if (sched.total_num_scheduled_tokens == n and len(sched.num_scheduled_tokens) == n
                    and core.last_num_prompt_tokens == 0):
                steps.append({"step": total, **timers.current})
        return steps, all_steps

    try:
        round_(warm_prompts, min(output_len, 16), "warm")
        other = OtherLoad()
        steps, all_steps = round_(prompts, output_len, "run")
        other_cores = other.cores()
    finally:
        timers.unwrap()
    if not steps:
        raise RuntimeError(f"N={n}: no step had all {n} requests decoding")
    for s in steps:
        for key in ("core", "schedule", "update", "execute", "sampler", "forward", "logits"):
            s.setdefault(key, 0.0)
        s["model"] = s["forward"] + s["logits"]
        s["overhead"] = s["step"] - s["model"]
        s["prep"] = s["execute"] - s["forward"] - s["logits"] - s["sampler"]
        s["core_other"] = s["core"] - s["schedule"] - s["execute"] - s["update"]
        s["output"] = s["step"] - s["core"]
    return summarize(steps, n, all_steps, other_cores)


def summarize(steps: list[dict], n: int, all_steps: int, other_cores: float) -> dict:
    keys = ["step", "forward", "logits", "model", "overhead", *PARTS]
    mean = {k: statistics.fmean(s[k] for s in steps if k in s) for k in keys if any(k in s for s in steps)}
    return {
        "num_requests": n,
        "decode_steps": len(steps),
        "all_steps": all_steps,
        "mean_s": mean,
        "median_step_s": statistics.median(s["step"] for s in steps),
        "overhead_fraction": mean["overhead"] / mean["step"],
        "other_processes_cores": other_cores,
    }


# -- Hugging Face -------------------------------------------------------------------------------


def run_hf(model, tokenizer, prompts: list[list[int]], output_len: int) -> dict:
    """A static batch through generate; per decode step: the time between consecutive stopping-criterion
    calls (one per generated token of the batch) and the forward time within it."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    marks: list[tuple[float, float]] = []  # (time, forward seconds so far) after each step
    forward_total = [0.0]
    original = model.forward

    def timed_forward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            forward_total[0] += time.perf_counter() - t0

    class StepMarks(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            marks.append((time.perf_counter(), forward_total[0]))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    pad_id = hf_pad_id(model, tokenizer)
    hf_generate_batch(model, prompts, min(output_len, 16), pad_id)  # warm-up
    model.forward = timed_forward
    other = OtherLoad()
    try:
        hf_generate_batch(model, prompts, output_len, pad_id, stopping_criteria=StoppingCriteriaList([StepMarks()]))
    finally:
        del model.forward
    other_cores = other.cores()
    marks = marks[:output_len]
    steps = [{"step": t1 - t0, "model": f1 - f0, "overhead": (t1 - t0) - (f1 - f0)}
             for (t0, f0), (t1, f1) in zip(marks, marks[1:])]
    mean = {k: statistics.fmean(s[k] for s in steps) for k in ("step", "model", "overhead")}
    return {
        "num_requests": len(prompts),
        "decode_steps": len(steps),
        "mean_s": mean,
        "median_step_s": statistics.median(s["step"] for s in steps),
        "overhead_fraction": mean["overhead"] / mean["step"],
        "other_processes_cores": other_cores,
    }


# -- report -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from tokenmill import LLM

    engine_kwargs = {"dtype": args.dtype, "quantization": args.quantization, "num_threads": args.num_threads,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    t = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)
    load_s = time.perf_counter() - t
    model_path = llm.engine.model_path
    dtype = str(llm.engine.core.dtype)
    tokenizer = llm.tokenizer
    text_ids = text_token_ids(tokenizer)
    ns = args.num_requests
    all_prompts = cut_prompts(text_ids, 2 * sum(ns), args.prompt_len)
    batches, k = {}, 0
    for n in ns:
        batches[n] = (all_prompts[k : k + n], all_prompts[k + n : k + 2 * n])  # (measured, warm-up)
        k += 2 * n
    print(f"model {model_path.name}; tokenmill {dtype}"
          f"{', ' + args.quantization if args.quantization else ''}; prompt {args.prompt_len} tokens, "
          f"{args.output_len} output tokens", flush=True)

    results = []
    for n in ns:
        print(f"tokenmill: {n} running requests ...", flush=True)
        results.append({"engine": "tokenmill", **run_tokenmill(llm, n, *batches[n], args.output_len)})
    del llm
    gc.collect()

    hf_dtype = args.hf_dtype or dtype
    if not args.skip_hf:
        print(f"hf-transformers: loading ({hf_dtype}) ...", flush=True)
        model = load_hf(model_path, hf_dtype)
        for n in ns:
            print(f"hf-transformers: batch {n} ...", flush=True)
            results.append({"engine": "hf-transformers", **run_hf(model, tokenizer, batches[n][0], args.output_len)})
        del model
        gc.collect()

    print()
    ms = lambda r, key: fmt(r["mean_s"][key] * 1000 if key in r["mean_s"] else None, ".2f")  # noqa: E731
    header = ["engine", "requests", "steps", "step ms", "forward ms", "logits ms", "overhead ms", "overhead %"]
    rows = [[r["engine"], str(r["num_requests"]), str(r["decode_steps"]), ms(r, "step"),
             ms(r, "forward") if "forward" in r["mean_s"] else ms(r, "model") + " (incl. logits)", ms(r, "logits"),
             ms(r, "overhead"), f"{r['overhead_fraction']:.1%}"] for r in results]
    print_table(header, rows)
    print()
    print("tokenmill overhead breakdown, ms per step (mean over decode steps):")
    header = ["requests", "schedule", "input prep", "sampler", "sched update", "core other", "output proc"]
    rows = [[str(r["num_requests"]), *(ms(r, part) for part in PARTS)] for r in results if r["engine"] == "tokenmill"]
    print_table(header, rows)
    print()
    print("step = engine.step() (HF: between tokens of generate); overhead = step - (forward + compute_logits); "
          "input prep = execute_model - forward - logits - sampler; output proc = engine.step - core.step")
    target = next((r for r in results if r["engine"] == "tokenmill" and r["num_requests"] == TARGET_REQUESTS), None)
    if target is not None:
        met = target["overhead_fraction"] <= TARGET_FRACTION
        print(f"target: overhead <= {TARGET_FRACTION:.0%} of the step at {TARGET_REQUESTS} running requests: "
              f"{target['overhead_fraction']:.1%}, {'met' if met else 'NOT met'}")
    warning = busy_warning({f"{r['engine']} N={r['num_requests']}": r["other_processes_cores"] for r in results})
    if warning:
        print(warning)

    write_report(
        args.output,
        "step_overhead",
        config={
            "model": args.model,
            "model_file": str(model_path),
            "num_requests": ns,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "tokenmill": engine_kwargs,
            "tokenmill_dtype": dtype,
            "tokenmill_load_seconds": load_s,
            "hf_dtype": None if args.skip_hf else hf_dtype,
            "text_file": str(TEXT_FILE),
            "greedy": True,
            "ignore_eos": True,
        },
        results=results,
        target={"num_requests": TARGET_REQUESTS, "max_overhead_fraction": TARGET_FRACTION,
                "overhead_fraction": target["overhead_fraction"] if target else None,
                "met": target["overhead_fraction"] <= TARGET_FRACTION if target else None},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
