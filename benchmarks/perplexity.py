#!/usr/bin/env python
"""Perplexity per config and path: GPL-3 with llama.cpp's protocol (`tokenmill eval ppl`:
non-overlapping windows, the second half of each scored), for each config of one model, and
the same text through `llama-perplexity` on the same GGUF file when its path is given.

Each config runs twice when `--few-row-steps N` is given: with the engine's default token budget
(prompts run as prefill, many rows a matmul) and with `max_num_batched_tokens=N` (every step a
few rows, the kernels decode uses). Configs are those of the other scripts (`bf16` = the weights
dequantized, dense; `auto` = as stored; `int8`, `int4` = weight-only quantization), each in
`--dtype`.

    python benchmarks/perplexity.py --configs bf16,auto --llama-perplexity PATH/llama-perplexity
    python benchmarks/perplexity.py --model PATH.gguf --configs bf16,auto --max-windows 4
    TOKENMILL_CPU_ISA=avx2 python benchmarks/perplexity.py --configs int8,int4 --dtype float32 --few-row-steps 8
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import time
from pathlib import Path

from common import RESULTS_DIR, TEXT_FILE, config_kwargs, config_label, parse_configs, print_table, write_report

from tokenmill import LLM
from tokenmill.eval.perplexity import gpl3_token_ids, perplexity
from tokenmill.models.registry import resolve_model

_LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def measure(model: str, name: str, dtype: str, window: int, max_windows: int | None, budget: int | None) -> dict:
    kwargs = {"dtype": dtype, **config_kwargs(name, dtype)}
    if budget is not None:
        kwargs["max_num_batched_tokens"] = budget
    llm = LLM(model, **kwargs)
    token_ids = gpl3_token_ids(llm.tokenizer, window, max_windows)
    start = time.perf_counter()
    value = perplexity(llm, token_ids, window)
    seconds = time.perf_counter() - start
    del llm
    gc.collect()
    return {"config": config_label(name, dtype), "path": "prefill" if budget is None else "few-row steps",
            "max_num_batched_tokens": budget, "perplexity": round(value, 4), "windows": len(token_ids) // window,
            "seconds": round(seconds, 1)}


def llama_perplexity(binary: str, gguf: Path, window: int, max_windows: int | None, threads: int) -> dict:
    cmd = [binary, "-m", str(gguf), "-f", str(TEXT_FILE), "-c", str(window), "-t", str(threads)]
    if max_windows is not None:
        cmd += ["--chunks", str(max_windows)]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = _LLAMA_PPL.search(out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"no 'Final estimate' in the output of {' '.join(cmd)}")
    return {"config": "llama.cpp llama-perplexity", "path": "as stored", "perplexity": float(found[1]),
            "stderr": float(found[2]), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path (default: smollm2-135m)")
    parser.add_argument("--configs", default="bf16,auto", help="comma-separated configs (default: bf16,auto)")
    parser.add_argument("--dtype", default="auto", help="compute dtype of every config (default: the engine's)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default: 512)")
    parser.add_argument("--max-windows", type=int, default=None, help="score the first N windows (default: all)")
    parser.add_argument("--few-row-steps", type=int, default=0, metavar="N",
                        help="also run each config in steps of N tokens (default: 0, prefill only)")
    parser.add_argument("--llama-perplexity", default=None, metavar="PATH",
                        help="llama.cpp's llama-perplexity: run it on the same GGUF file")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity threads (default: 2)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "perplexity.json", help="JSON report path")
    args = parser.parse_args()
    budgets = [None] + ([args.few_row_steps] if args.few_row_steps else [])
    results = [measure(args.model, name, args.dtype, args.window, args.max_windows, budget)
               for name in parse_configs(args.configs) for budget in budgets]
    if args.llama_perplexity:
        gguf = Path(resolve_model(args.model))
        if gguf.suffix != ".gguf":
            raise SystemExit(f"--llama-perplexity needs a GGUF model, got {gguf}")
        results.append(llama_perplexity(args.llama_perplexity, gguf, args.window, args.max_windows, args.threads))
    print_table(["config", "path", "perplexity", "s"],
                [[r["config"], r["path"], f"{r['perplexity']:.4f}", f"{r['seconds']:.1f}"] for r in results])
    write_report(args.output, "perplexity", vars(args), results)


if __name__ == "__main__":
    main()
