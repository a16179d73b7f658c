#!/usr/bin/env python
"""Prefill speed (prompt tokens/s): tokenmill vs a Hugging Face forward (and llama.cpp's
`llama-bench -p N -n 0` with `--llama-bench PATH`).

tokenmill, per config of `--configs` (as in decode_latency.py; default bf16), loaded one at a time:
- one at a time: `--num-prompts` requests of `--prompt-len` tokens, each alone with max_tokens=1,
  after a warm-up request. Its TTFT (first token - arrival) is the prefill: with the default
  max_num_batched_tokens (2048) a 512-token prompt is one engine step. Prompt tokens / TTFT,
  median over the requests.
- all at once: `--num-prompts` other prompts in one `generate` (max_tokens=1), after a warm-up batch
  of the same shape; prompt tokens / the call's wall time.
Every prompt is a different slice of the GPL-3 text (token ids), so none hits the prefix cache.

Hugging Face: the same GGUF in `--hf-dtype`, one forward `model(input_ids, logits_to_keep=1)` of one
prompt under `torch.inference_mode` (logits of the last position only, as `generate`'s prefill
and tokenmill compute), median of `--repeats` after a warm-up.

    python benchmarks/prefill_speed.py --llama-bench /tmp/lcpp/build/bin/llama-bench
    python benchmarks/prefill_speed.py --prompt-len 32 --num-prompts 2 --repeats 1   # smoke test
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
    CONFIG_NAMES, RESULTS_DIR, TEXT_FILE, OtherLoad, busy_warning, config_kwargs, config_label, cut_prompts, device_name, fmt,
    load_hf, parse_configs, print_ratios, print_table, run_llama_bench, text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "prefill_speed.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="Prefill prompt tok/s of tokenmill configs (one request at a time, and all at once) vs one "
        "Hugging Face forward (and llama.cpp's llama-bench).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--configs", default="bf16",
                   help=f"tokenmill configs, comma-separated, from {','.join(CONFIG_NAMES)}: bf16 = dtype --dtype, "
                        "int8/int4 = weight-only quantized linears, auto = the checkpoint's weights as stored (the "
                        "engine's default compute dtype)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype of the bf16 config line (float32 to measure fp32 instead)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (cut from the GPL-3 text)")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="tokenmill: prompts run one at a time (median reported), and as many again all at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokenmill: token budget per engine step (a prompt longer than it is prefilled in chunks)")
    p.add_argument("--repeats", type=int, default=3, help="HF forwards (median reported); llama-bench's -r")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (and llama-bench -t); None = tokenmill's default, the physical core count")
    p.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face transformers reference")
    p.add_argument("--hf-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the Hugging Face model is loaded in")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="path of llama.cpp's llama-bench binary (e.g. /tmp/lcpp/build/bin/llama-bench) to measure "
                        "llama.cpp on the same GGUF file; left out if not given")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    try:
        args.configs = parse_configs(args.configs)
    except ValueError as e:
        p.error(str(e))
    for name in ("prompt_len", "num_prompts", "repeats", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run_tokenmill(llm, prompts: list[list[int]], num_prompts: int) -> dict:
    """prompts: 1 warm-up, `num_prompts` one at a time, `num_prompts` warm-up batch, `num_prompts` batch."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    single = prompts[1 : 1 + num_prompts]
    warm_batch = prompts[1 + num_prompts : 1 + 2 * num_prompts]
    batch = prompts[1 + 2 * num_prompts :]
    llm.generate([prompts[0]], params)

    other = OtherLoad()
    ttfts = []
    for prompt in single:
        out = llm.generate([prompt], params)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    single_cores = other.cores()
    n = len(prompts[0])

    llm.generate(warm_batch, params)
    other = OtherLoad()
    t0 = time.perf_counter()
    llm.generate(batch, params)
    batch_s = time.perf_counter() - t0
    return {
        "ttft_s": statistics.median(ttfts),
        "prompt_tok_per_s": statistics.median(n / t for t in ttfts),
        "ttfts_s": ttfts,
        "batch_prompts": len(batch),
        "batch_seconds": batch_s,
        "batch_prompt_tok_per_s": len(batch) * n / batch_s,
        "other_processes_cores": max(single_cores, other.cores()),
    }


def run_hf(model, prompts: list[list[int]], repeats: int) -> dict:
    """One forward per prompt (prompts[0] warms up), logits of the last position only."""
    import torch

    def forward(prompt):
        with torch.inference_mode():
            model(torch.tensor([prompt], dtype=torch.long), logits_to_keep=1)

    forward(prompts[0])
    other = OtherLoad()
    times = []
    for k in range(repeats):
        prompt = prompts[1 + k % (len(prompts) - 1)]
        t0 = time.perf_counter()
        forward(prompt)
        times.append(time.perf_counter() - t0)
    n = len(prompts[0])
    return {
        "ttft_s": statistics.median(times),
        "prompt_tok_per_s": statistics.median(n / t for t in times),
        "forward_seconds": times,
        "other_processes_cores": other.cores(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from tokenmill import LLM
    from tokenmill.config import EngineConfig
    from tokenmill.models.registry import resolve_model

    threads = EngineConfig(num_threads=args.num_threads).resolved_num_threads()
    torch.set_num_threads(threads)
    model_path = resolve_model(args.model)
    print(f"model {model_path.name}; prompts of {args.prompt_len} tokens; {threads} threads; {device_name('cpu')}", flush=True)

    results = []
    tokenizer = prompts = None
    for name in args.configs:
        kwargs = {**config_kwargs(name, args.dtype), "num_threads": args.num_threads,
                  "max_num_batched_tokens": args.max_num_batched_tokens}
        print(f"tokenmill {name}: loading ({kwargs}) ...", flush=True)
        t = time.perf_counter()
        llm = LLM(args.model, **kwargs)
        load_s = time.perf_counter() - t
        if prompts is None:
            tokenizer = llm.tokenizer
            prompts = cut_prompts(text_token_ids(tokenizer), 1 + 3 * args.num_prompts, args.prompt_len)
        dtype = str(llm.engine.core.dtype)
        r = run_tokenmill(llm, prompts, args.num_prompts)
        label = config_label(name, args.dtype)
        results.append({"engine": f"tokenmill {label}", "config": label, "llm_kwargs": kwargs,
                        "weights": dtype if name == "bf16" else f"{name} ({dtype} compute)",
                        "load_seconds": load_s, **r})
        del llm
        gc.collect()

    if not args.skip_hf:
        if tokenizer is None:
            from tokenmill.models.loader import load_checkpoint

            tokenizer = load_checkpoint(model_path).tokenizer
            prompts = cut_prompts(text_token_ids(tokenizer), 1 + 3 * args.num_prompts, args.prompt_len)
        print(f"hf-transformers: loading ({args.hf_dtype}) ...", flush=True)
        t = time.perf_counter()
        model = load_hf(model_path, args.hf_dtype)
        load_s = time.perf_counter() - t
        r = run_hf(model, prompts[: 1 + args.num_prompts], args.repeats)
        results.append({"engine": "hf-transformers (one forward)", "weights": args.hf_dtype, "load_seconds": load_s,
                        "attn_implementation": getattr(model.config, "_attn_implementation", None), **r})
        del model
        gc.collect()

    if args.llama_bench:
        if model_path.suffix != ".gguf":
            raise SystemExit(f"--llama-bench needs a .gguf model, got {model_path}")
        print("llama.cpp: llama-bench ...", flush=True)
        rec = run_llama_bench(args.llama_bench, model_path, threads, args.prompt_len, 0, args.repeats)
        results.append({"engine": "llama.cpp (llama-bench)", "weights": rec.get("model_type", "gguf"),
                        "ttft_s": args.prompt_len / rec["avg_ts"], "prompt_tok_per_s": rec["avg_ts"],
                        "prompt_tok_per_s_stddev": rec.get("stddev_ts"),
                        "other_processes_cores": rec["other_processes_cores"], "llama_bench": rec})

    print()
    header = ["engine", "weights", "prefill ms", "prompt tok/s", f"{args.num_prompts} at once: tok/s"]
    rows = [[r["engine"], r["weights"], fmt(r["ttft_s"] * 1000), fmt(r["prompt_tok_per_s"]),
             fmt(r.get("batch_prompt_tok_per_s"))] for r in results]
    print_table(header, rows, left=2)
    print()
    print(f"prompt tok/s = {args.prompt_len} / prefill time: tokenmill TTFT of one request (median of "
          f"{args.num_prompts}), HF one forward (median of {args.repeats}), llama-bench avg_ts; "
          f"'at once': {args.num_prompts} prompts in one generate, prompt tokens / wall time")
    print_ratios(results, ("hf-transformers (one forward)", "llama.cpp (llama-bench)"), "prompt_tok_per_s",
                 "prompt tok/s (one at a time)")
    warning = busy_warning({r["engine"]: r["other_processes_cores"] for r in results})
    if warning:
        print(warning)

    write_report(
        args.output,
        "prefill_speed",
        config={
            "model": args.model,
            "model_file": str(model_path),
            "configs": args.configs,
            "dtype_bf16_line": args.dtype,
            "hf_dtype": None if args.skip_hf else args.hf_dtype,
            "prompt_len": args.prompt_len,
            "num_prompts": args.num_prompts,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "repeats": args.repeats,
            "threads": threads,
            "llama_bench": args.llama_bench,
            "text_file": str(TEXT_FILE),
        },
        results=results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
