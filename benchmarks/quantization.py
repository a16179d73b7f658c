#!/usr/bin/env python
"""Accuracy and speed of every quantization of one model, side by side: the table of docs/quantization.md.

Each config is one row of `tokenmill quantize`'s accuracy report (`tokenmill.quantization.report`):
GPL-3 perplexity (the whole text unless `--ppl-max-windows`), greedy exact match on the same
`--gsm8k-problems` GSM8K problems and the share of them answered with the same number as the
original, size on disk and of the weights in memory, KV cache bytes per token, and decode tok/s at
batch 1 and 32 (64 tokens per request). Weight configs are quantized exactly as `tokenmill quantize`
does (fp32, calibrated on GSM8K minus the evaluated problems) into `--work-dir`, then loaded from
there; KV cache configs load the original with `--kv-cache-dtype`.

KV rows (`kv-*`, including the `kv-bf16` reference) run with `--kv-max-num-batched-tokens` (128):
GPL-3 windows of 512 are then prefilled in chunks, whose later tokens read the (quantized) cache
as decoding does; with the default budget a window is prefilled in one step and never reads it.
Their perplexity change is against `kv-bf16`, the others' against `bf16`.

    python benchmarks/quantization.py                                   # every config (~25 min here)
    python benchmarks/quantization.py --configs bf16,int4-g128,int4-g128-awq --gsm8k-problems 0
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import shutil
from pathlib import Path

from common import RESULTS_DIR, fmt, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "quantization.json"

# name -> (tokenmill quantize's method, algorithm, group size) or ("kv", KV cache dtype)
CONFIGS: dict[str, tuple] = {
    "bf16": (None,),
    "int8": ("int8", "rtn", 32),
    "int4-g32": ("int4", "rtn", 32),
    "int4-g32-awq": ("int4", "awq", 32),
    "int4-g32-gptq": ("int4", "gptq", 32),
    "int4-g128": ("int4", "rtn", 128),
    "int4-g128-awq": ("int4", "awq", 128),
    "int4-g128-gptq": ("int4", "gptq", 128),
    "w8a8": ("w8a8", "rtn", 32),
    "w8a8-smoothquant": ("w8a8", "smoothquant", 32),
    "fp8": ("fp8", "rtn", 32),
    "kv-bf16": ("kv", "auto"),
    "kv-int8": ("kv", "int8"),
    "kv-fp8": ("kv", "fp8"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="compute dtype of every row")
    p.add_argument("--gsm8k-problems", type=int, default=100, help="GSM8K problems per row, 0 = skip")
    p.add_argument("--gsm8k-max-tokens", type=int, default=256, help="answer length limit")
    p.add_argument("--ppl-max-windows", type=int, default=None, help="score only the first N 512-token windows of GPL-3")
    p.add_argument("--calibration-samples", type=int, default=64, help="calibration windows of the calibrated configs")
    p.add_argument("--calibration-seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--kv-max-num-batched-tokens", type=int, default=128,
                   help="token budget per engine step of the kv-* rows (prefill chunks that read the cache)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokenmill-quantization-bench"),
                   help="where the quantized checkpoints are written (each removed after its row)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON report")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if not args.configs or unknown:
        p.error(f"--configs: expected a comma-separated subset of {','.join(CONFIGS)}, got {unknown or 'nothing'}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import resolve_model
    from tokenmill.quantization.cli import report_problems
    from tokenmill.quantization.quantize import QuantConfig, quantize_checkpoint
    from tokenmill.quantization.report import ReportSettings, disk_bytes, gsm8k_agreement, measure

    source = resolve_model(args.model)
    checkpoint = load_checkpoint(source)
    settings = ReportSettings(dtype=args.dtype, ppl_max_windows=args.ppl_max_windows,
                              gsm8k_problems=args.gsm8k_problems, gsm8k_max_tokens=args.gsm8k_max_tokens)
    problems, exclude = report_problems(settings.gsm8k_problems)
    rows, quantize_seconds = {}, {}
    for name in args.configs:
        spec = CONFIGS[name]
        if spec[0] is None:  # the source's weights dense (a GGUF file's quantized tensors dequantized)
            rows[name] = measure(name, str(source), disk_bytes(source), settings, problems, quantization="none")
        elif spec[0] == "kv":
            rows[name] = measure(name, str(source), disk_bytes(source), settings, problems, quantization="none",
                                 kv_cache_dtype=spec[1], max_num_batched_tokens=args.kv_max_num_batched_tokens)
        else:
            method, algorithm, group_size = spec
            qconfig = QuantConfig(method=method, algorithm=algorithm, group_size=group_size,
                                  calibration_samples=args.calibration_samples, calibration_seq_len=args.calibration_seq_len)
            out = args.work_dir / name
            quantize_seconds[name] = quantize_checkpoint(checkpoint, qconfig, out, torch.bfloat16, exclude)
            rows[name] = measure(name, str(out), disk_bytes(out), settings, problems)
            shutil.rmtree(out)
        gc.collect()
        row = rows[name]
        print(f"{name}: ppl {row.perplexity:.3f}, GSM8K {row.gsm8k_correct}, {row.decode_tok_s} tok/s "
              f"({row.seconds + quantize_seconds.get(name, 0):.0f} s)", flush=True)

    results, table = [], []
    for name, row in rows.items():
        base = rows.get("kv-bf16" if CONFIGS[name][0] == "kv" else "bf16")
        change = None if base is None else (row.perplexity / base.perplexity - 1) * 100
        agree = None if base is None else gsm8k_agreement(row, base)
        results.append({**dataclasses.asdict(row), "config": name, "ppl_change_pct": change, "gsm8k_same_answer": agree,
                        "quantize_seconds": quantize_seconds.get(name)})
        table.append([name, f"{row.perplexity:.3f}", "-" if change is None else f"{change:+.2f}%",
                      "-" if row.gsm8k_correct is None else f"{row.gsm8k_correct}/{len(problems)}",
                      "-" if agree is None else f"{agree:.0%}", fmt(row.disk_mb), fmt(row.memory_mb),
                      str(row.kv_bytes_per_token), *(fmt(row.decode_tok_s[b]) for b in sorted(row.decode_tok_s)),
                      fmt(quantize_seconds.get(name), ".0f")])
    print()
    print_table(["config", "GPL-3 ppl", "vs base", "GSM8K", "same answer", "disk MB", "memory MB", "KV B/token",
                 "tok/s b1", "tok/s b32", "quantize s"], table)
    write_report(args.output, "quantization", {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                 results, gsm8k_problem_indices=[p.index for p in problems])


if __name__ == "__main__":
    main()
