#!/usr/bin/env python
"""Decode speed on a GPU: batch-1 decode tok/s and the share of the device's memory bandwidth it
reaches, and the decode step time at batch 1, 8 and 64, with and without CUDA graphs.

Bandwidth: `dst.copy_(src)` of two `--bandwidth-mib` tensors on the device, timed with CUDA events
(best of 10 after 2 warm-ups), counting the bytes read and written. A decode step reads every
weight once, whatever the batch: weight bytes per step = the model's tensors less those only
indexed per token (an untied embedding table, rotary caches), as `decode_latency.py` counts them.
Fraction of bandwidth = weight bytes x steps/s / copy bandwidth.

tokenmill, for each CUDA-graph setting (on a GPU off and on, `enforce_eager`; on a CPU the one
way it runs, reported as "not available"), loaded once:
for each batch size B of `--batch-sizes`, one warm-up batch, then `--repeats` batches of B
requests submitted together (`--prompt-len` prompt tokens each, cut from GPL-3 at distinct
offsets; `--output-len` tokens, greedy, EOS ignored). They are prefilled in one step and then decode in lockstep, so a request's
(last token time - first token time) / (n - 1) is the decode step time; the median over the
requests, then over the repeats, is reported. Batch-1 decode tok/s = 1 / the batch-1 step time.

    python benchmarks/gpu_decode.py --synthetic qwen2.5-1.5b                # on the GPU
    python benchmarks/gpu_decode.py --model PATH.gguf --attention-backend triton
    python benchmarks/gpu_decode.py --device cpu --model smollm2-135m --dtype float32 --batch-sizes 1,2 --output-len 8 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR, TEXT_FILE, add_model_args, benchmark_model, copy_bandwidth,
    cut_prompts, device_name, fmt, print_table, resolve_device, tensor_bytes,
    text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "gpu_decode.json"
DEFAULT_MODEL = "qwen2.5-coder-1.5b"  # the GPU figures' model, used when tokenmill has this alias


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.models.registry import MODEL_ALIASES

    default_model = DEFAULT_MODEL if DEFAULT_MODEL in MODEL_ALIASES else None
    p = argparse.ArgumentParser(
        description="Batch-1 decode tok/s and its share of the device's copy bandwidth; decode step time at several "
        "batch sizes with and without CUDA graphs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p, default_model, f"default: the alias {DEFAULT_MODEL} when tokenmill has it (it has "
                   f"{'it' if default_model else 'not'}), else one of --model / --synthetic is required")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto = cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="compute dtype")
    p.add_argument("--batch-sizes", default="1,8,64", help="comma-separated batch sizes (1 gives the batch-1 tok/s)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (cut from the GPL-3 text)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (exact: EOS is ignored)")
    p.add_argument("--repeats", type=int, default=3, help="measured batches per batch size (after one warm-up)")
    p.add_argument("--attention-backend", default=None,
                   choices=["auto", "torch", "triton"],
                   help="the engine's attention backend (default: its own default, auto)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="measure only with (or without) CUDA graphs; default: both, on a GPU (on a CPU: not available)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV-cache budget (default: the engine's auto sizing)")
    p.add_argument("--bandwidth-mib", type=int, default=None,
                   help="size of each tensor of the bandwidth copy (default: 1024 on cuda, 256 on cpu)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes: at least one, each >= 1")
    for name in ("prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (a decode step needs a token after the first)")
    if args.model is None and args.synthetic is None:
        p.error(f"tokenmill has no alias {DEFAULT_MODEL}: pass --model (e.g. the Qwen2.5-Coder-1.5B GGUF assembled "
                "as ../shared/MODELS.md says) or --synthetic qwen2.5-1.5b (random weights of its shape)")
    if args.model is not None and args.synthetic is not None and args.model != default_model:
        p.error("give --model or --synthetic, not both")
    if args.synthetic:
        args.model = None
    return args


# -- measurement --------------------------------------------------------------------------------


def decode_step_time(llm, batches: list[list[list[int]]], output_len: int) -> dict:
    """batches[0] warms up; each other batch is submitted at once. Per batch, the median over its
    requests of (last - first token time) / (n - 1); then the median over the batches."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    per_batch = []
    for i, prompts in enumerate(batches):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = []
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n != output_len:
                raise RuntimeError(f"request {out.request_id}: {n} output tokens, expected {output_len}")
            m = out.metrics
            steps.append((m.last_token_time - m.first_token_time) / (n - 1))
        if i:
            per_batch.append({"step_s": statistics.median(steps), "max_request_step_s": max(steps), "wall_s": wall})
    step = statistics.median(b["step_s"] for b in per_batch)
    return {"step_s": step, "batches": per_batch}


def run_setting(model: str, engine_kwargs: dict, args, prompts_by_batch: dict[int, list[list[list[int]]]]) -> tuple[list[dict], dict]:
    """Load one engine, measure every batch size; rows for the table and the engine facts."""
    import torch

    from tokenmill import LLM

    t = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    load_s = time.perf_counter() - t
    core = llm.engine.core
    if core.device != engine_kwargs["device"]:
        raise RuntimeError(f"the engine runs on {core.device}, not {engine_kwargs['device']}")
    weights = tensor_bytes(core.runner.model)
    facts = {"load_seconds": load_s, "kv_blocks": core.runner.num_blocks, "block_size": core.config.block_size,
             "dtype": str(core.dtype), **weights}
    rows = []
    for batch in args.batch_sizes:
        print(f"  batch {batch} ...", flush=True)
        r = decode_step_time(llm, prompts_by_batch[batch], args.output_len)
        rows.append({"batch_size": batch, **r, "tok_per_s": batch / r["step_s"],
                     "weight_bytes_per_s": weights["read_per_token_bytes"] / r["step_s"]})
    del llm, core
    gc.collect()
    if engine_kwargs["device"] == "cuda":
        torch.cuda.empty_cache()
    return rows, facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    device = resolve_device(args.device)
    model = benchmark_model(args, device)
    bw = copy_bandwidth(device, (args.bandwidth_mib or (1024 if device == "cuda" else 256)) * 2**20)
    bandwidth = bw["best_bytes_per_s"]
    print(f"{device_name(device)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s best, {bw['median_bytes_per_s'] / 1e9:.0f} "
          f"GB/s median (read + write, {bw['bytes_copied'] >> 20} MiB copy_)", flush=True)

    engine_kwargs = {
        "dtype": args.dtype,
        "device": device,
        "max_num_seqs": max(args.batch_sizes),
        # every prompt of a batch prefilled in one step, so the batch decodes in lockstep
        "max_num_batched_tokens": max(2048, max(args.batch_sizes) * args.prompt_len),
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
    }
    if device != "cuda":
        print(f"CUDA graphs: not available on {device}; measuring the engine as it runs")
        settings = [None]
    else:
        settings = [args.cuda_graphs] if args.cuda_graphs is not None else [False, True]

    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import resolve_model

    tokenizer = load_checkpoint(resolve_model(model)).tokenizer
    text_ids = text_token_ids(tokenizer)
    prompts_by_batch = {}
    for batch in args.batch_sizes:
        flat = cut_prompts(text_ids, (args.repeats + 1) * batch, args.prompt_len)
        prompts_by_batch[batch] = [flat[i * batch : (i + 1) * batch] for i in range(args.repeats + 1)]

    results = []
    facts = {}
    for graphs in settings:
        kwargs = engine_kwargs | ({"enforce_eager": not graphs} if graphs is not None else {})
        label = "not available" if graphs is None else "on" if graphs else "off"
        print(f"tokenmill, CUDA graphs {label}: loading {model} ({kwargs}) ...", flush=True)
        rows, facts = run_setting(model, kwargs, args, prompts_by_batch)
        for r in rows:
            r["cuda_graphs"] = label
            r["fraction_of_copy_bandwidth"] = r["weight_bytes_per_s"] / bandwidth
        results.extend(rows)

    print()
    print_table(
        ["CUDA graphs", "batch", "decode step ms", "tok/s", "weights GB/s", "of copy bandwidth"],
        [[r["cuda_graphs"], str(r["batch_size"]), fmt(r["step_s"] * 1000, ".2f"), fmt(r["tok_per_s"]),
          fmt(r["weight_bytes_per_s"] / 1e9), f"{r['fraction_of_copy_bandwidth']:.0%}"] for r in results],
    )
    print()
    batch1 = [r for r in results if r["batch_size"] == 1]
    best = max(batch1, key=lambda r: r["tok_per_s"], default=None)
    if best:
        print(f"batch-1 decode: {best['tok_per_s']:.1f} tok/s (CUDA graphs {best['cuda_graphs']}); weights read per "
              f"token {facts['read_per_token_bytes'] / 1e9:.2f} GB -> {best['weight_bytes_per_s'] / 1e9:.0f} GB/s = "
              f"{best['fraction_of_copy_bandwidth']:.0%} of the measured copy bandwidth ({bandwidth / 1e9:.0f} GB/s); "
              f"{args.dtype}, model {Path(model).name}{' (synthetic weights)' if args.synthetic else ''}")
    graph_rows = {r["batch_size"]: r for r in results if r["cuda_graphs"] == "on"}
    for r in results:
        if r["cuda_graphs"] == "off" and r["batch_size"] in graph_rows:
            print(f"batch {r['batch_size']}: CUDA graphs {r['step_s'] / graph_rows[r['batch_size']]['step_s']:.2f}x "
                  "faster per step")

    write_report(
        args.output,
        "gpu_decode",
        config={
            "model": model,
            "synthetic": args.synthetic,
            "device": device,
            "device_name": device_name(device),
            "dtype": args.dtype,
            "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "engine_kwargs": engine_kwargs,
            "text_file": str(TEXT_FILE),
            "greedy": True,
            "ignore_eos": True,
        },
        results=results,
        engine=facts,
        bandwidth=bw,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
