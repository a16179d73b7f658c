#!/usr/bin/env python
"""Offline throughput: tokenmill's in-flight batching vs Hugging Face `generate` with static batches.

The workload is N requests whose prompt and output lengths are drawn uniformly (inclusive) from
ranges with a fixed seed. Prompts are token ids sliced at random offsets out of real English text
(`/usr/share/common-licenses/GPL-3`, tokenized with the model's tokenizer). Every request ignores
EOS, so each produces exactly its drawn number of output tokens; decoding is greedy.

tokenmill: one `LLM.generate` call over all N requests (after a small warm-up generate), timed
with a wall clock; mean TTFT and mean time per output token come from the request metrics.

Hugging Face: the same requests, in request order (not sorted by length unless
`--hf-sort-by-length`), cut into static batches of `--hf-batch-size`, left-padded (with an
attention mask), each batch generated with `min_new_tokens = max_new_tokens =` the longest
requested output in that batch (HF cannot stop sequences of a static batch at different
lengths). Only the requested output tokens of each request count as useful output tokens; the
raw number of generated tokens (batch size x longest output, per batch) is reported too.

Both engines run in this one process, on the same device (`--device`, default cuda when
available), with the same dtype and the same torch thread count; on a GPU the tokenmill engine is
deleted and the CUDA cache emptied before Hugging Face loads. With `--attention-backends
torch,triton` tokenmill runs
once per backend, each a fresh engine, and the backends are compared too.

    python benchmarks/offline_throughput.py                       # 64 requests, 32:512 in, 32:256 out
    python benchmarks/offline_throughput.py --num-requests 4 --input-len 16:32 --output-len 8:16 --hf-batch-size 2
    python benchmarks/offline_throughput.py --synthetic qwen2.5-1.5b --num-requests 256 --input-len 100:1024 \
        --output-len 100:1024 --hf-batch-size 64 --attention-backends torch,triton      # the GPU workload
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR, TEXT_FILE, OtherLoad, add_model_args, benchmark_model, busy_warning, device_name,
    hf_generate_batch, hf_pad_id, load_hf, print_table, resolve_device, run_hf, text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "offline_throughput.json"


# -- arguments ----------------------------------------------------------------------------------


def length_range(value: str) -> tuple[int, int]:
    """'MIN:MAX' (inclusive) or 'N' (fixed)."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {value!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="Offline throughput of tokenmill (one in-flight batch) vs Hugging Face transformers "
        "generate (static, left-padded batches in request order) on the same greedy, ignore-EOS workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p, d.model)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="device of both engines; auto = cuda when available")
    p.add_argument("--num-requests", type=int, default=64, help="number of requests N")
    p.add_argument("--input-len", type=length_range, default="32:512", metavar="MIN:MAX",
                   help="prompt length range in tokens, drawn uniformly (inclusive)")
    p.add_argument("--output-len", type=length_range, default="32:256", metavar="MIN:MAX",
                   help="output length range in tokens, drawn uniformly (inclusive); exact, EOS is ignored")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype of both engines; default: what tokenmill's dtype 'auto' resolves to on the "
                        "device (bf16 on CUDA and on CPUs with native bf16, else fp32)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for HF generate")
    p.add_argument("--hf-sort-by-length", action="store_true",
                   help="sort requests by prompt length before cutting HF batches, instead of request order")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokenmill: token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="tokenmill: most requests running at once")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb,
                   help="tokenmill: KV cache memory budget (default: auto, see --gpu-memory-utilization on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="tokenmill on CUDA with the KV cache sized automatically: the fraction of GPU memory it may use")
    p.add_argument("--attention-backends", default=None, metavar="NAME[,NAME]",
                   help="tokenmill: run once per attention backend (e.g. torch,triton); default: the engine's "
                        "default (auto: triton on CUDA, torch on CPU)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads for both engines; None = tokenmill's default, the physical core count")
    p.add_argument("--skip-hf", action="store_true", help="run tokenmill only")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (lengths and prompt offsets)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    if args.synthetic and args.model != d.model:
        p.error("give --model or --synthetic, not both")
    args.attention_backends = [b.strip() for b in args.attention_backends.split(",") if b.strip()] if args.attention_backends else []
    return args


# -- workload -----------------------------------------------------------------------------------


def make_workload(tokenizer, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int):
    """[(prompt_token_ids, output_len)], prompts sliced from the text at random offsets."""
    text_ids = text_token_ids(tokenizer)
    if input_len[1] > len(text_ids):
        raise SystemExit(f"--input-len max {input_len[1]} exceeds the {len(text_ids)} tokens of {TEXT_FILE}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        start = rng.randint(0, len(text_ids) - n_in)
        requests.append((list(text_ids[start : start + n_in]), n_out))
    return requests, len(text_ids)


# -- tokenmill ----------------------------------------------------------------------------------


def run_tokenmill(llm, requests) -> tuple[dict, list[list[int]]]:
    from tokenmill import SamplingParams

    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    scheduler = getattr(getattr(llm.engine, "core", None), "scheduler", None)
    preempt_before = getattr(scheduler, "num_preemptions", None)

    other = OtherLoad()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    other_cores = other.cores()

    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    for (prompt, n), o, ids in zip(requests, outs, out_ids):
        if len(ids) != n or list(o.prompt_token_ids) != prompt:
            raise RuntimeError(f"tokenmill request {o.request_id}: {len(ids)} output tokens, expected {n}")
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tpots = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(ids) - 1)
        for o, ids in zip(outs, out_ids)
        if len(ids) > 1
    ]
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(len(ids) for ids in out_ids)
    result = {
        "engine": "tokenmill",
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (prompt_tokens + output_tokens) / seconds,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "max_ttft_s": max(ttfts),
        "mean_tpot_s": sum(tpots) / len(tpots) if tpots else None,
        "preemptions": (scheduler.num_preemptions - preempt_before) if preempt_before is not None else None,
        "other_processes_cores": other_cores,
    }
    return result, out_ids


# -- Hugging Face -------------------------------------------------------------------------------


def greedy_agreement(a: list[list[int]], b: list[list[int]], eos_ids: set[int]) -> dict:
    """Share of output positions on which the two engines agree, counted up to the first
    disagreement of each request (after one, the continuations differ and are not comparable),
    and up to the first EOS (HF's min_new_tokens masks EOS; tokenmill's ignore_eos does not)."""
    matched = compared = identical = 0
    for x, y in zip(a, b):
        limit = len(x)
        for k, t in enumerate(x):
            if t in eos_ids:
                limit = k
                break
        n = 0
        while n < limit and n < len(y) and x[n] == y[n]:
            n += 1
        matched += n
        compared += limit
        identical += n == limit
    return {
        "prefix_match_tokens": matched,
        "compared_tokens": compared,
        "prefix_match_share": matched / compared if compared else None,
        "identical_requests": identical,
    }


# -- report -------------------------------------------------------------------------------------


def print_results(results: list[dict]) -> None:
    header = ["engine", "requests", "prompt tok", "output tok", "seconds", "output tok/s", "total tok/s"]
    rows = [
        [
            r["engine"],
            str(r["requests"]),
            str(r["prompt_tokens"]),
            str(r["output_tokens"]),
            f"{r['seconds']:.2f}",
            f"{r['output_tok_per_s']:.1f}",
            f"{r['total_tok_per_s']:.1f}",
        ]
        for r in results
    ]
    print_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.config import EngineConfig

    device = resolve_device(args.device)
    dtype = args.dtype or EngineConfig().resolved_dtype(device)
    model = benchmark_model(args, device)
    engine_kwargs = {
        "device": device,
        "dtype": dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_threads": args.num_threads,
    }
    backends: list[str | None] = list(args.attention_backends) or [None]

    requests = tokenizer = model_path = warm_prompts = text_tokens = None
    tm_results: list[dict] = []
    tm_ids = None
    eos_ids: set[int] = set()
    for backend in backends:
        kwargs = engine_kwargs | ({"attention_backend": backend} if backend else {})
        t = time.perf_counter()
        llm = LLM(model, **kwargs)  # sets torch's thread count for the whole process
        load_s = time.perf_counter() - t
        if llm.engine.core.device != device:
            raise RuntimeError(f"tokenmill runs on {llm.engine.core.device}, not {device}")
        if requests is None:
            tokenizer = llm.tokenizer
            model_path = llm.engine.model_path
            requests, text_tokens = make_workload(tokenizer, args.num_requests, args.input_len, args.output_len, args.seed)
            longest = max(len(p) + n for p, n in requests)
            if longest > llm.engine.max_model_len:
                raise SystemExit(f"a request of {longest} tokens exceeds max_model_len {llm.engine.max_model_len}")
            print(
                f"workload: {len(requests)} requests, prompt {args.input_len[0]}:{args.input_len[1]}, "
                f"output {args.output_len[0]}:{args.output_len[1]}, seed {args.seed}; {device} "
                f"({device_name(device)}), dtype {dtype}, {torch.get_num_threads()} torch threads; model {model_path.name}"
                + (" (synthetic weights)" if args.synthetic else ""),
                flush=True,
            )
            # Warm-up: a couple of short requests through the whole path.
            warm_prompts = [p[:16] for p, _ in requests[:2]]
            eos_ids = set(getattr(llm.engine, "eos_token_ids", []) or [])
        llm.generate(warm_prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        label = f"tokenmill ({backend})" if backend else "tokenmill"
        print(f"running {label} ...", flush=True)
        result, ids = run_tokenmill(llm, requests)
        result.update(engine=label, attention_backend=backend, load_seconds=load_s,
                      kv_blocks=llm.engine.core.runner.num_blocks)
        tm_results.append(result)
        tm_ids = tm_ids or ids
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    results = list(tm_results)

    hf_result = agreement = None
    if not args.skip_hf:
        print("loading Hugging Face model ...", flush=True)
        t = time.perf_counter()
        hf_model = load_hf(model_path, dtype, device)
        hf_load_s = time.perf_counter() - t
        hf_generate_batch(hf_model, warm_prompts, 4, hf_pad_id(hf_model, tokenizer))  # warm-up
        print(f"running HF generate (batch size {args.hf_batch_size}) ...", flush=True)
        hf_result, hf_ids = run_hf(hf_model, tokenizer, requests, args.hf_batch_size, args.hf_sort_by_length)
        hf_result["load_seconds"] = hf_load_s
        results.append(hf_result)
        agreement = greedy_agreement(tm_ids, hf_ids, eos_ids)

    print()
    print_results(results)
    print()
    for tm in tm_results:
        print(
            f"{tm['engine']}: mean TTFT {tm['mean_ttft_s'] * 1000:.0f} ms (max {tm['max_ttft_s'] * 1000:.0f} ms), "
            f"mean time per output token {tm['mean_tpot_s'] * 1000:.1f} ms"
            if tm["mean_tpot_s"] is not None
            else f"{tm['engine']}: mean TTFT {tm['mean_ttft_s'] * 1000:.0f} ms",
            end="",
        )
        print(f", preemptions {tm['preemptions']}" if tm.get("preemptions") is not None else "")
    ratios = {}
    if hf_result is not None:
        ratios = {tm["engine"]: tm["output_tok_per_s"] / hf_result["output_tok_per_s"] for tm in tm_results}
        print(
            f"HF: {hf_result['generated_tokens']} tokens generated for {hf_result['output_tokens']} requested "
            f"({hf_result['raw_generated_tok_per_s']:.1f} raw tok/s), batches of {args.hf_batch_size} in "
            f"{hf_result['batch_order']}, left-padded"
        )
        print(
            f"greedy agreement ({tm_results[0]['engine']}): {agreement['prefix_match_share']:.1%} of output tokens "
            f"match HF up to the first divergence; {agreement['identical_requests']}/{len(requests)} requests identical"
        )
        for engine, ratio in ratios.items():
            print(f"ratio {engine} / HF, output tok/s: {ratio:.2f}x")
    for tm in tm_results[1:]:
        print(f"ratio {tm['engine']} / {tm_results[0]['engine']}, output tok/s: "
              f"{tm['output_tok_per_s'] / tm_results[0]['output_tok_per_s']:.2f}x")
    warning = busy_warning({r["engine"]: r["other_processes_cores"] for r in results})
    if warning:
        print(warning)

    write_report(
        args.output,
        "offline_throughput",
        config={
            "model": model,
            "model_file": str(model_path),
            "synthetic": args.synthetic,
            "device": device,
            "device_name": device_name(device),
            "num_requests": args.num_requests,
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "dtype": dtype,
            "seed": args.seed,
            "hf_batch_size": args.hf_batch_size,
            "hf_batch_order": "sorted by prompt length" if args.hf_sort_by_length else "request order",
            "skip_hf": args.skip_hf,
            "tokenmill": engine_kwargs,
            "attention_backends": [b for b in backends if b],
            "text_file": str(TEXT_FILE),
            "text_tokens": text_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        results=results,
        ratio_output_tok_per_s_tokenmill_over_hf=ratios.get(tm_results[0]["engine"]),
        ratios_output_tok_per_s_over_hf=ratios,
        greedy_agreement=agreement,
        workload={
            "prompt_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
