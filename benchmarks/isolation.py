"""Isolation: does a request's greedy output depend on what runs beside it?

For each engine setting, 32 prompts (8 tasks x 4 variants behind one system line, as
tests/engine/test_speculative.py uses) are generated one at a time and then all together in
shuffled order, with prefix caching and n-gram speculation on; the report counts the prompts
whose tokens differ and where they first diverge. fp32 is expected to give 0 (the test asserts
it); the other rows say how far batch invariance holds elsewhere.

    python benchmarks/isolation.py [--configs fp32,fp32-no-kernels,bf16,bf16-no-kernels,bf16-int8-kv,int4-as-stored,int8]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from common import RESULTS_DIR, write_report

from tokenmill import LLM, SamplingParams

_SYSTEM = "You are a terse assistant. Continue the text exactly in the style it starts in.\n\n"
_TASKS = ["Count: 1, 2, 3, 4, 5, 6, 7, 8,", "The cat sat on the mat. The cat sat on the mat. The cat",
          "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "Monday, Tuesday, Wednesday,",
          "A: red, B: green, C: blue, A: red, B:", "Paris is in France. Rome is in Italy. Madrid",
          "<li>one</li>\n<li>two</li>\n<li>", "x = x + 1\ny = y + 1\nz ="]
PROMPTS = [f"{_SYSTEM}{task} (variant {v})\n{task}" for v in range(4) for task in _TASKS]

CONFIGS = {
    "fp32": dict(dtype="float32"),
    "fp32-no-kernels": dict(dtype="float32", cpu_kernels=False),
    "bf16": dict(dtype="bfloat16"),
    "bf16-no-kernels": dict(dtype="bfloat16", cpu_kernels=False),
    "bf16-int8-kv": dict(dtype="bfloat16", kv_cache_dtype="int8"),
    "int4-as-stored": dict(dtype="bfloat16", quantization="auto"),  # the GGUF file's Q4_1 codes
    "int8": dict(dtype="bfloat16", quantization="int8"),
}
SETTINGS = {  # each config as the flags a user would give
    "fp32": "fp32, CPU kernels (`--dtype float32 --quantization none`)",
    "fp32-no-kernels": "fp32, PyTorch ops (`--no-cpu-kernels`)",
    "bf16": "bf16, CPU kernels (`--dtype bfloat16 --quantization none`)",
    "bf16-no-kernels": "bf16, PyTorch ops",
    "bf16-int8-kv": "bf16, int8 KV cache (`--kv-cache-dtype int8`)",
    "int4-as-stored": "int4 as stored in the GGUF file (`--quantization auto`, the default)",
    "int8": "int8 weights (`--quantization int8`)",
}


def measure(name: str, max_tokens: int) -> dict:
    kwargs = {"quantization": None, **CONFIGS[name]}
    llm = LLM("smollm2-135m", kv_cache_memory_gb=0.25, max_num_batched_tokens=256, speculative_method="ngram",
              num_speculative_tokens=4, speculative_ngram_min=1, speculative_ngram_max=3, speculative_max_running=8,
              **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    alone = {p: llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS}
    order = random.Random(0).sample(PROMPTS, len(PROMPTS))
    together = {p: o.outputs[0].token_ids for p, o in zip(order, llm.generate(order, params))}
    diverged = [next(i for i, (a, b) in enumerate(zip(alone[p], together[p])) if a != b)
                for p in PROMPTS if alone[p] != together[p]]
    return {"config": name, "setting": SETTINGS[name], "prompts": len(PROMPTS), "max_tokens": max_tokens, "differ": len(diverged),
            "first_divergence": sorted(diverged),
            "first_differing_tokens": ", ".join(str(i + 1) for i in sorted(diverged)), "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "isolation.json", help="JSON report path")
    args = parser.parse_args()
    results = []
    for name in args.configs.split(","):
        results.append(measure(name, args.max_tokens))
        print(json.dumps(results[-1]), flush=True)
    write_report(args.output, "isolation", {"configs": args.configs, "max_tokens": args.max_tokens}, results)


if __name__ == "__main__":
    main()
