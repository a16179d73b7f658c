#!/usr/bin/env python
"""Prefill attention alone: tokenmill's CPU kernel against PyTorch's SDPA, one layer, side by side.

For each prompt length of `--lengths`: a paged bf16 KV cache (`--block-size`) holding one
prompt's keys and values (random, blocks in a shuffled order) and the prompt's queries, as the
model makes them (rows strided: q and k rotated together). Timed, alternating, in this process:

    kernel  paged_prefill_attention (tokenmill/csrc/cpu_prefill.cpp) over the cache, every chunk
            of the step in one call: what the torch backend runs with the CPU kernels
    sdpa    the torch backend's own path for a fresh prompt: causal F.scaled_dot_product_attention
            on the chunk's K/V (GQA as zero-stride views), what it ran before the kernel

`--context N` puts N tokens of earlier context before the prompt (a chunk after a prefix-cache
hit, or a later chunk of chunked prefill): SDPA then gathers the blocks and takes an explicit
mask, the kernel reads them in place. Each median over `--repeats` alternated rounds of ~0.3 s;
GFLOP/s counts the causal half (4 * heads * head_dim * tokens attended per query, summed).
Also printed: the largest and mean difference of each against an fp32 reference of the same
bf16 inputs. Needs a CPU with AVX-512 BF16 (the kernel is not built elsewhere).

    python benchmarks/prefill_attention.py
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

    g = torch.Generator().manual_seed(q_len)
    heads, kv_heads, hd, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    seq_len = args.context + q_len
    blocks = -(-seq_len // bs)
    order = torch.randperm(blocks, generator=g)
    key_cache = torch.randn(blocks, bs, kv_heads, hd, generator=g).bfloat16()
    value_cache = torch.randn(blocks, bs, kv_heads, hd, generator=g).bfloat16()
    query = torch.randn(q_len, heads + kv_heads, hd, generator=g).bfloat16()[:, :heads]
    table = order.to(torch.int32)[None]
    seq_lens, query_lens = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([q_len], dtype=torch.int32)
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    scale = hd**-0.5

    def kernel():
        kernels.paged_prefill_attention(out, query, key_cache, value_cache, table, seq_lens, query_lens, scale)
        return out

    own_k = key_cache[order].flatten(0, 1)[:seq_len]  # the step's own K/V, as a fresh prompt's SDPA takes them
    own_v = value_cache[order].flatten(0, 1)[:seq_len]

    def sdpa():
        if args.context == 0:
            return TorchAttentionBackend._prefill(query, own_k, own_v, 0, scale)
        # after earlier context, as the backend does it: the blocks gathered, an explicit mask
        k = key_cache.index_select(0, order).flatten(0, 1)[:seq_len]
        v = value_cache.index_select(0, order).flatten(0, 1)[:seq_len]
        return TorchAttentionBackend._prefill(query, k, v, args.context, scale)

    k32, v32 = own_k.float(), own_v.float()
    reference = TorchAttentionBackend._prefill(query.float(), k32, v32, args.context, scale).float()
    errors = {}
    for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
        diff = (fn().float() - reference).abs()
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
    if kernels is None or not kernels.prefill_attention_supported():
        print(f"the prefill kernel is not built here ({cpu_kernels.build_error() or 'needs AVX-512 BF16'})")
        return 1
    load = OtherLoad()
    results = [one_length(kernels, args, int(n)) for n in args.lengths.split(",")]
    other = load.cores()
    print(f"\n{args.heads}:{args.kv_heads} heads x {args.head_dim}, bf16, block size {args.block_size}, "
          f"context {args.context}, {torch.get_num_threads()} threads; medians of {args.repeats} alternated rounds\n")
    rows = [[str(r["prompt_len"]), fmt(r["kernel"]["ms"], ".3f"), fmt(r["sdpa"]["ms"], ".3f"), fmt(r["speedup"], ".2f") + "x",
             fmt(r["kernel"]["gflops"], ".0f"), fmt(r["sdpa"]["gflops"], ".0f"),
             f'{r["kernel"]["max_abs_err"]:.4f} / {r["kernel"]["mean_abs_err"]:.5f}',
             f'{r["sdpa"]["max_abs_err"]:.4f} / {r["sdpa"]["mean_abs_err"]:.5f}'] for r in results]
    print_table(["tokens", "kernel ms", "sdpa ms", "speedup", "kernel GFLOP/s", "sdpa GFLOP/s",
                 "kernel err max / mean", "sdpa err max / mean"], rows)
    warning = busy_warning({"timed runs": other})
    if warning:
        print(warning)
    write_report(Path(args.output), "prefill_attention", vars(args), results, other_cores=other)
    return 0


if __name__ == "__main__":
    sys.exit(main())
