#!/usr/bin/env python
"""Greedy parity with Hugging Face transformers on a device, on models built there from real
configurations with random weights (`--synthetic`, benchmarks/common.py): no model file travels.

For each model, 4 prompts cut from the GPL-3 text:
- tokenmill in fp32 (`quantization="none"`, the device's default attention backend: triton on
  CUDA) generates `--max-tokens` greedy tokens per prompt;
- transformers in fp32 scores prompt + those tokens in one forward pass: tokenmill's greedy output
  is token-identical to transformers' greedy generate exactly when every generated token is the
  argmax of transformers' logits at its position (by induction over the positions). A position
  where they differ is reported with transformers' margin between its choice and ours;
- the same sequences' token log-probabilities, tokenmill's (`prompt_logprobs`) in fp32 and in bf16
  against transformers' fp32: max |difference| over every scored position.

    python benchmarks/gpu_parity.py                                   # on the GPU: smollm2-135m, qwen2.5-1.5b
    python benchmarks/gpu_parity.py --device cpu --synthetic tiny --max-tokens 4 --attention-backend triton
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR, SYNTHETIC_MODELS, cut_prompts, device_name, load_hf, resolve_device, synthetic_model_dir,
    text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "gpu_parity.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tokenmill's greedy tokens and log-probabilities against transformers' "
                                "(fp32) on random-weight models of real shapes.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--synthetic", default="smollm2-135m,qwen2.5-1.5b",
                   help=f"comma-separated model shapes, of: {', '.join(SYNTHETIC_MODELS)}")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto = cuda when available")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="tokenmill's attention backend")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48, help="prompt tokens (cut from the GPL-3 text)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="also score the sequences with tokenmill in bf16")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json")
    args = p.parse_args(argv)
    args.synthetic = [n.strip() for n in args.synthetic.split(",") if n.strip()]
    unknown = [n for n in args.synthetic if n not in SYNTHETIC_MODELS]
    if unknown:
        p.error(f"--synthetic: unknown {unknown}; choose from {list(SYNTHETIC_MODELS)}")
    return args


def release(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def tokenmill_runs(model_dir: Path, device: str, dtype: str, backend: str, prompts, max_tokens: int | None,
                   sequences=None):
    """Greedy outputs of the prompts (max_tokens) or, with `sequences`, their token log-probs."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, dtype=dtype, quantization="none", attention_backend=backend,
              kv_cache_memory_gb=1.0)
    try:
        if sequences is None:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            return [list(o.outputs[0].token_ids) for o in outs]
        outs = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True))
        return [o.prompt_logprobs[1:] for o in outs]
    finally:
        del llm
        release(device)


def compare(name: str, args, device: str) -> dict:
    import torch

    model_dir = synthetic_model_dir(name, device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = cut_prompts(text_token_ids(tokenizer), args.num_prompts, args.prompt_len)
    t0 = time.perf_counter()
    outputs = tokenmill_runs(model_dir, device, "float32", args.attention_backend, prompts, args.max_tokens)
    sequences = [p + o for p, o in zip(prompts, outputs)]

    hf = load_hf(model_dir, "float32", device)
    mismatches, hf_logprobs = [], []
    with torch.inference_mode():
        for i, seq in enumerate(sequences):
            logits = hf(torch.tensor([seq], device=device)).logits[0].float()  # [len, vocab]
            hf_logprobs.append(torch.log_softmax(logits, dim=-1)[torch.arange(len(seq) - 1), seq[1:]].cpu())
            start = len(prompts[i]) - 1  # the row that predicts the first generated token
            choice = logits[start : len(seq) - 1].argmax(dim=-1).cpu()
            ours = torch.tensor(seq[start + 1 :])
            for j in (choice != ours).nonzero().flatten().tolist():
                row = logits[start + j]
                mismatches.append({"prompt": i, "position": j, "transformers": int(choice[j]), "tokenmill": int(ours[j]),
                                   "margin": float(row[choice[j]] - row[ours[j]])})
    del hf
    release(device)

    result = {
        "model": name, "prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "attention_backend": args.attention_backend, "greedy_identical": not mismatches, "mismatches": mismatches[:16],
    }
    for dtype in ("float32", "bfloat16") if args.bf16 else ("float32",):
        ours = tokenmill_runs(model_dir, device, dtype, args.attention_backend, None, None, sequences)
        diff = max(float((torch.tensor(o, dtype=torch.float32) - r).abs().max()) for o, r in zip(ours, hf_logprobs))
        result[f"logprob_max_abs_diff_{dtype}"] = diff
    result["seconds"] = time.perf_counter() - t0
    print(f"{name}: greedy identical {result['greedy_identical']} ({len(mismatches)} positions differ), "
          + ", ".join(f"{k} {v:.2e}" for k, v in result.items() if k.startswith("logprob_")), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    results = [compare(name, args, device) for name in args.synthetic]
    write_report(args.output, "gpu_parity", {**vars(args), "output": str(args.output), "device": device}, results,
                 device_name=device_name(device))
    return 0 if all(r["greedy_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
