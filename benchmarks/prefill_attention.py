#!/usr/bin/env python
"""Prefill attention alone: tokenmill's CPU kernel against PyTorch's SDPA, one layer, side by side.

For each prompt length of `--lengths`: a paged KV cache (`--block-size`; the compute dtype
`--dtype`, bf16 or float32, or int8 codes and scales with `--kv-cache-dtype int8`) holding one
prompt's keys and values (random, blocks in a shuffled order) and the prompt's queries, as the
model makes them (rows strided: q and k rotated together). Timed, alternating, in this process:

    kernel  paged_prefill_attention (tokenmill/csrc/cpu_prefill.cpp), every chunk of the step in
            one call, as the torch backend calls it with the CPU kernels
    sdpa    the torch backend's own path where the kernel does not run: for a fresh prompt, causal
            F.scaled_dot_product_attention on the chunk's own K/V (GQA as zero-stride views)

`--context N` puts N tokens of earlier context before the prompt (a chunk after a prefix-cache
hit, or a later chunk of chunked prefill): SDPA then gathers the blocks (int8: dequantized) and
takes an explicit mask; the kernel reads them in place. Each median over `--repeats` alternated
rounds of ~0.3 s; GFLOP/s counts the causal half (4 * heads * head_dim * keys attended, summed
over queries). Also printed: the largest and mean difference of each from a float64 reference
of the same inputs, and the instruction-set level the kernels were built for. bf16 needs a CPU
with AVX-512 BF16, float32 one with AVX2 + FMA (`prefill_attention_dtypes()`); to measure the
AVX2 kernel and PyTorch's AVX2 code on an AVX-512 machine, cap both:
`TOKENMILL_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2`.

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --dtype float32 --lengths 128,512,2048
    python benchmarks/prefill_attention.py --context 1024 --lengths 128,512 --kv-cache-dtype int8
    python benchmarks/prefill_attention.py --heads 32 --kv-heads 8 --head-dim 128 --lengths 512,2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, OtherLoad, busy_warning, fmt, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "prefill_attention.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="CPU prefill attention: tokenmill's kernel vs PyTorch SDPA, one layer",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths (query tokens), comma-separated")
    p.add_argument("--context", type=int, default=0, help="tokens of earlier context in the cache before the prompt")
    p.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, choices=[64, 128], help="head size")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the compute dtype: queries, outputs and a non-quantized cache")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the cache's dtype (auto: the compute dtype; int8: codes and scales, as kv_cache_dtype int8)")
    p.add_argument("--repeats", type=int, default=5, help="alternated timing rounds per length")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", type=str, default=str(DEFAULT_OUTPUT), metavar="PATH.json", help="JSON report")
    return p.parse_args(argv)


def time_call(fn, seconds: float = 0.3) -> float:
    """Mean ms per call over about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e3


def one_length(kernels, args, q_len: int) -> dict:
    from tokenmill.layers.attention import TorchAttentionBackend
    from tokenmill.layers.attention.backend import _gather
    from tokenmill.layers.attention.kv_quant import quantize_kv

    g = torch.Generator().manual_seed(q_len)
    heads, kv_heads, hd, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    seq_len = args.context + q_len
    blocks = -(-seq_len // bs)
    order = torch.randperm(blocks, generator=g)
    cache = full = tuple(torch.randn(blocks, bs, kv_heads, hd, generator=g).to(dtype) for _ in range(2))
    if args.kv_cache_dtype == "int8":  # (key codes, value codes, key scales, value scales)
        (kc, ks), (vc, vs) = (quantize_kv(c, torch.int8) for c in full)
        cache = (kc, vc, ks, vs)
    query = torch.randn(q_len, heads + kv_heads, hd, generator=g).to(dtype)[:, :heads]
    table = order.to(torch.int32)[None]
    seq_lens, query_lens = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([q_len], dtype=torch.int32)
    out = torch.empty(query.shape, dtype=dtype)
    scale = hd**-0.5
    # every key in sequence order as the cache holds it (int8: dequantized), and the step's own
    # K/V, the last q_len (in full precision: what an int8 cache quantized)
    cached_k, cached_v = (x.flatten(0, 1)[:seq_len] for x in _gather(cache, order, dtype))
    own_k, own_v = (x[order].flatten(0, 1)[args.context : seq_len] for x in full)

    def kernel():  # as the torch backend calls it
        kernels.paged_prefill_attention(out, query, cache[0], cache[1], table, seq_lens, query_lens, scale, *cache[2:],
                                        key=own_k, value=own_v)
        return out

    def sdpa():  # the torch backend's path where the kernel does not run
        if args.context == 0:  # a fresh prompt: its own K/V
            return TorchAttentionBackend._prefill(query, own_k, own_v, 0, scale)
        k, v = (x.flatten(0, 1)[:seq_len] for x in _gather(cache, order, dtype))  # blocks gathered, a mask
        return TorchAttentionBackend._prefill(query, k, v, args.context, scale)

    k_ref, v_ref = (own_k, own_v) if args.context == 0 else (cached_k, cached_v)
    reference = TorchAttentionBackend._prefill(query.double(), k_ref.double(), v_ref.double(), args.context, scale)
    errors = {}
    for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
        diff = (fn().double() - reference).abs()
        errors[name] = (diff.max().item(), diff.mean().item())
    times = {"kernel": [], "sdpa": []}
    for _ in range(args.repeats):
        for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
            times[name].append(time_call(fn))
    flops = 4 * heads * hd * sum(args.context + i + 1 for i in range(q_len))
    result = {"prompt_len": q_len, "context": args.context}
    for name in times:
        ms = statistics.median(times[name])
        result[name] = {"ms": ms, "gflops": flops / ms / 1e6, "max_abs_err": errors[name][0],
                        "mean_abs_err": errors[name][1]}
    result["speedup"] = result["sdpa"]["ms"] / result["kernel"]["ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from tokenmill.layers import cpu_kernels

    kernels = cpu_kernels.load()
    dtype = getattr(torch, args.dtype)
    if kernels is None or dtype not in kernels.prefill_attention_dtypes():
        need = "AVX-512 BF16" if dtype == torch.bfloat16 else "AVX2 + FMA"
        print(f"the {args.dtype} prefill kernel is not built here ({cpu_kernels.build_error() or 'needs ' + need})")
        return 1
    load = OtherLoad()
    results = [one_length(kernels, args, int(n)) for n in args.lengths.split(",")]
    other = load.cores()
    cache = args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    print(f"\n{args.heads}:{args.kv_heads} heads x {args.head_dim}, {args.dtype}, {cache} cache, block size {args.block_size}, "
          f"context {args.context}, {torch.get_num_threads()} threads, kernels built for {kernels.isa()} "
          f"(PyTorch's CPU capability {torch.backends.cpu.get_cpu_capability()}); "
          f"medians of {args.repeats} alternated rounds\n")
    rows = [[str(r["prompt_len"]), fmt(r["kernel"]["ms"], ".3f"), fmt(r["sdpa"]["ms"], ".3f"), fmt(r["speedup"], ".2f") + "x",
             fmt(r["kernel"]["gflops"], ".0f"), fmt(r["sdpa"]["gflops"], ".0f"),
             f'{r["kernel"]["max_abs_err"]:.1e} / {r["kernel"]["mean_abs_err"]:.1e}',
             f'{r["sdpa"]["max_abs_err"]:.1e} / {r["sdpa"]["mean_abs_err"]:.1e}'] for r in results]
    print_table(["tokens", "kernel ms", "sdpa ms", "speedup", "kernel GFLOP/s", "sdpa GFLOP/s",
                 "kernel err max / mean", "sdpa err max / mean"], rows)
    warning = busy_warning({"timed runs": other})
    if warning:
        print(warning)
    write_report(Path(args.output), "prefill_attention", vars(args), results, other_cores=other, isa=kernels.isa(),
                 torch_cpu_capability=torch.backends.cpu.get_cpu_capability())
    return 0


if __name__ == "__main__":
    sys.exit(main())
