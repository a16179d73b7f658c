"""The CPU kernels' quantized matmuls against fp32 F.linear (and, where the level has native bf16,
against the bf16 layer the model would otherwise run: DenseLinear, oneDNN / bf16_linear) at one
instruction-set level, over the
default model's four matrix shapes (qkv, o, gate_up, down) in `--layers` copies (30 as in the
model, so the weights stream from memory as in a decode step; 1 keeps them in cache): microseconds
per layer at several row counts, and at 1 row the weight bytes read per second. Prints a table
and writes JSON.

    TOKENMILL_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python benchmarks/cpu_matmul.py --isa avx2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.cpu_isa import host_isa
from tokenmill.layers import cpu_kernels
from tokenmill.layers.linear import DenseLinear, Int4Linear, Int8Linear
from tokenmill.layers.quantization.formats import dequantize_record, record_from_rtn

from common import RESULTS_DIR, write_report

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)


def per_call_us(f, repeats: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default=None, help="kernel level (default: the host's, capped by TOKENMILL_CPU_ISA)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts, comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="copies of the four matrices (default 30)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "cpu_matmul.json")
    args = parser.parse_args()
    isa = args.isa or host_isa()
    kernels = cpu_kernels.load(isa)
    if kernels is None:
        raise SystemExit(f"CPU kernels ({isa}) not built: {cpu_kernels.build_error(isa)}")
    g = torch.Generator().manual_seed(0)
    layers, dense = [], []
    bf16 = kernels.native_bf16()
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g) * 0.05
            layers.append((w, Int8Linear(record_from_rtn("int8", w, 32), None, kernels=kernels),
                           Int4Linear(record_from_rtn("int4", w, 32), None, kernels)))
            if bf16:
                dense.append(DenseLinear(w.bfloat16(), None, kernels))
    weight_bytes = {
        "fp32": sum(w.numel() * 4 for w, _, _ in layers),
        "int8": sum((l8.codes if l8.tiles is None else l8.tiles).numel() + l8.scales.numel() * 2 for _, l8, _ in layers),
        "int4": sum(l4.kernel_codes.numel() + l4.kernel_pairs.numel() * 2 for _, _, l4 in layers),
        "bf16": sum(w.numel() * 2 for w, _, _ in layers),
    }
    rows_out = []
    print(f"CPU kernels {isa} (host {host_isa()}), {torch.get_num_threads()} threads; us per layer of {SHAPES}, "
          f"{args.layers} layers")
    print(f"{'rows':>5} {'fp32':>8} {'bf16':>8} {'int8':>8} {'int4':>8} {'int8/fp32':>10} {'int4/fp32':>10} "
          f"{'int4/bf16':>10} {'max rel err':>12}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        err = 0.0
        for (w, l8, l4), x in zip(layers[:len(SHAPES)], xs):
            for name, layer in (("int8", l8), ("int4", l4)):
                ref = F.linear(x, dequantize_record(name, record_from_rtn(name, w, 32)).float())
                err = max(err, ((layer(x).float() - ref).abs().max() / ref.abs().max()).item())
        # the quantized layers take x in the level's compute dtype (bf16 with native bf16), as in the model
        xq = [x.bfloat16() for x in xs] if bf16 else xs
        calls = {
            "fp32": lambda: [F.linear(xs[i % len(SHAPES)], w) for i, (w, _, _) in enumerate(layers)],
            "int8": lambda: [l8(xq[i % len(SHAPES)]) for i, (_, l8, _) in enumerate(layers)],
            "int4": lambda: [l4(xq[i % len(SHAPES)]) for i, (_, _, l4) in enumerate(layers)],
        }
        if bf16:
            calls["bf16"] = lambda: [d(xq[i % len(SHAPES)]) for i, d in enumerate(dense)]
        total = {name: per_call_us(f, args.repeats) / args.layers for name, f in calls.items()}
        row = {"rows": m, **{k: round(v, 1) for k, v in total.items()}, "max_rel_err": err}
        if m == 1:
            row["weight_gb_per_s"] = {k: round(weight_bytes[k] / args.layers / (v * 1e3), 1) for k, v in total.items()}
        rows_out.append(row)
        b = total.get("bf16")
        bf16_us, int4_vs_bf16 = (f"{b:.0f}", f"{total['int4'] / b:.2f}") if b else ("-", "-")
        print(f"{m:>5} {total['fp32']:>8.0f} {bf16_us:>8} {total['int8']:>8.0f} {total['int4']:>8.0f} "
              f"{total['int8'] / total['fp32']:>10.2f} {total['int4'] / total['fp32']:>10.2f} {int4_vs_bf16:>10} "
              f"{err:>12.4f}")
    if rows_out and "weight_gb_per_s" in rows_out[0]:
        print("weight bytes read per second at 1 row (GB/s): "
              + ", ".join(f"{k} {v}" for k, v in rows_out[0]["weight_gb_per_s"].items()))
    write_report(args.output, "cpu_matmul", {"isa": isa, "host_isa": host_isa(), "shapes": SHAPES, "layers": args.layers,
                                             "repeats": args.repeats}, rows_out)


if __name__ == "__main__":
    main()
