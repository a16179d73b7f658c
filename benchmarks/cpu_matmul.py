"""The CPU kernels' quantized matmuls against fp32 F.linear at one instruction-set level, over four
of the default model's matrix shapes (qkv, o, gate_up, down): summed microseconds per call at
several row counts. Prints a table and writes JSON.

    TOKENMILL_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python benchmarks/cpu_matmul.py --isa avx2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_kernels
from tokenmill.layers.cpu_isa import host_isa
from tokenmill.layers.linear import Int4Linear, Int8Linear
from tokenmill.quantization.formats import dequantize_record, record_from_rtn

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
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "cpu_matmul.json")
    args = parser.parse_args()
    isa = args.isa or host_isa()
    kernels = cpu_kernels.load(isa)
    if kernels is None:
        raise SystemExit(f"CPU kernels ({isa}) not built: {cpu_kernels.build_error(isa)}")
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        layers.append((w, Int8Linear(record_from_rtn("int8", w, 32), None, kernels=kernels),
                       Int4Linear(record_from_rtn("int4", w, 32), None, kernels)))
    rows_out = []
    print(f"CPU kernels {isa} (host {host_isa()}), {torch.get_num_threads()} threads; us per call summed over {SHAPES}")
    print(f"{'rows':>5} {'fp32':>8} {'int8':>8} {'int4':>8} {'int8/fp32':>10} {'int4/fp32':>10} {'max rel err':>12}")
    for m in (int(r) for r in args.rows.split(",")):
        total = {"fp32": 0.0, "int8": 0.0, "int4": 0.0}
        err = 0.0
        for w, l8, l4 in layers:
            x = torch.randn(m, w.shape[1], generator=g)
            for name, layer in (("int8", l8), ("int4", l4)):
                ref = F.linear(x, dequantize_record(name, record_from_rtn(name, w, 32)).float())
                err = max(err, ((layer(x).float() - ref).abs().max() / ref.abs().max()).item())
            total["fp32"] += per_call_us(lambda: F.linear(x, w), args.repeats)
            total["int8"] += per_call_us(lambda: l8(x), args.repeats)
            total["int4"] += per_call_us(lambda: l4(x), args.repeats)
        rows_out.append({"rows": m, **{k: round(v, 1) for k, v in total.items()}, "max_rel_err": err})
        print(f"{m:>5} {total['fp32']:>8.0f} {total['int8']:>8.0f} {total['int4']:>8.0f} "
              f"{total['int8'] / total['fp32']:>10.2f} {total['int4'] / total['fp32']:>10.2f} {err:>12.4f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"isa": isa, "host_isa": host_isa(), "shapes": SHAPES, "results": rows_out}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
