#!/usr/bin/env python
"""Peak host memory while loading a model, against the bytes of its runtime weights.

Each config loads the model in a fresh process (`LLM(model, ...)` with the smallest KV cache),
which reports its peak resident set (ru_maxrss), its resident set before loading (Python, torch,
the tokenizer libraries), what the checkpoint's metadata and tokenizer add (read first, without
the weights: a 150k-token vocabulary's tokenizer is ~0.3 GB), the bytes of the model's tensors
as they run (`tensor_bytes`), and the load time. The ratio is (peak - before - tokenizer) /
weights: what loading the weights costs against the weights it leaves behind.

    python benchmarks/load_memory.py                                    # the default model
    python benchmarks/load_memory.py --model path/to/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --configs bf16,int4,auto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import RESULTS_DIR, config_kwargs, fmt, parse_configs, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "load_memory.json"

CHILD = r"""
import json, resource, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["bench_dir"])
import torch
from tokenmill import LLM
from tokenmill.models.loader import load_checkpoint
from tokenmill.models.registry import resolve_model
from common import tensor_bytes
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
rss0 = rss()
checkpoint = load_checkpoint(resolve_model(args["model"]))  # the tokenizer is cached: LLM reuses it
tokenizer = rss() - rss0
del checkpoint
llm = LLM(args["model"], kv_cache_memory_gb=0.01, **args["kwargs"])
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kv = sum(t.numel() * t.element_size() for layer in llm.engine.core.runner.kv_caches for t in layer)
print(json.dumps({"before_bytes": before, "peak_bytes": peak, "tokenizer_bytes": tokenizer,
                  "kv_cache_bytes": kv, "load_seconds": seconds,
                  **tensor_bytes(llm.engine.core.runner.model)}))
"""


def measure(model: str, name: str, dtype: str) -> dict:
    from pathlib import Path

    args = {"model": model, "kwargs": config_kwargs(name, dtype), "bench_dir": str(Path(__file__).resolve().parent)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the loading process failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    loading = result["peak_bytes"] - result["before_bytes"] - result["tokenizer_bytes"]
    return {"config": name, **result, "loading_bytes": loading, "ratio": loading / result["total_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path (.gguf file or HF directory)")
    parser.add_argument("--configs", default="bf16,int8,int4,auto",
                        help="comma-separated: bf16 (dense), int8, int4 (quantized on load), auto (as stored: a GGUF "
                             "file's own int4 codes)")
    parser.add_argument("--dtype", default="auto", help="compute dtype for every config (auto, bfloat16, float32)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="JSON report path")
    args = parser.parse_args()
    results = [measure(args.model, name, args.dtype) for name in parse_configs(args.configs)]
    gb = 1e9
    print_table(["config", "weights GB", "peak RSS GB", "before GB", "tokenizer GB", "loading GB", "loading / weights",
                 "load s"],
                [[r["config"], fmt(r["total_bytes"] / gb, ".3f"), fmt(r["peak_bytes"] / gb, ".3f"),
                  fmt(r["before_bytes"] / gb, ".3f"), fmt(r["tokenizer_bytes"] / gb, ".3f"),
                  fmt(r["loading_bytes"] / gb, ".3f"), fmt(r["ratio"], ".2f"), fmt(r["load_seconds"])]
                 for r in results])
    from pathlib import Path

    write_report(Path(args.output), "load_memory", vars(args), results)


if __name__ == "__main__":
    main()
