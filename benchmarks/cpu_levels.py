#!/usr/bin/env python
"""The quantized matmul kernels (int4, int8, int6 layers as the engine builds them) at two or more
instruction-set levels, side by side in one process: for each row count and format, every level
runs the same weights and inputs in turn, round after round, and the fastest round of each is
kept, so a level's ratio to the first is measured under the same load. The weights are random,
in the shapes of one of the models (`--shapes`), `--copies` times, so that they stream from
memory as in a decode step. Prints microseconds per set of matrices and each level's speedup over
the first, and writes JSON.

    python benchmarks/cpu_levels.py --levels avx512,avx512_vnni
    python benchmarks/cpu_levels.py --levels avx2,avx512_vnni --shapes qwen2.5-1.5b --copies 3 --rows 1,64,256

A level runs only where the CPU executes it, and TOKENMILL_CPU_ISA caps which; oneDNN is not
involved (these layers run tokenmill's kernels at every row count).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import RESULTS_DIR, SYNTHETIC_MODELS, OtherLoad, busy_warning, print_table, write_report

FORMATS = ("int4", "int8", "int6")


def layer_shapes(name: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of a model's fused linear layers: qkv, o, gate_up, down."""
    c = SYNTHETIC_MODELS[name]
    hidden, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    return [(qkv, hidden), (hidden, c["num_attention_heads"] * head_dim), (2 * c["intermediate_size"], hidden),
            (hidden, c["intermediate_size"])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="avx2,avx512_vnni",
                   help="instruction-set levels, comma-separated; ratios are to the first (default: avx2,avx512_vnni)")
    p.add_argument("--shapes", choices=[name for name in SYNTHETIC_MODELS if name != "tiny"], default="smollm2-135m",
                   help="whose linear layers' shapes (default: smollm2-135m)")
    p.add_argument("--copies", type=int, default=30,
                   help="copies of the shapes, each with its own random weights (default 30: the default model's layers)")
    p.add_argument("--rows", default="1,4,16,64,256", help="row counts, comma-separated (default 1,4,16,64,256)")
    p.add_argument("--rounds", type=int, default=7, help="rounds per row count and format; the fastest is kept")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "cpu_levels.json", metavar="PATH.json")
    args = p.parse_args(argv)
    args.levels = [name.strip() for name in args.levels.split(",") if name.strip()]
    args.rows = [int(r) for r in args.rows.split(",")]
    if len(args.levels) < 2:
        p.error("--levels: name at least two levels")
    if args.copies < 1 or args.rounds < 1 or min(args.rows) < 1:
        p.error("--copies, --rounds and every --rows value must be >= 1")
    return args


def build_layers(module, weights: list, fmt: str) -> list:
    from tokenmill.layers.linear import Int4Linear, Int6Linear, Int8Linear
    from tokenmill.layers.quantization.formats import record_from_rtn

    cls = {"int4": Int4Linear, "int8": Int8Linear, "int6": Int6Linear}[fmt]
    return [cls(record_from_rtn(fmt, w, 32), None, kernels=module) for w in weights]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tokenmill.layers import cpu_kernels

    modules, runnable = {}, cpu_kernels.loadable_levels()
    for level in args.levels:
        if level not in runnable:
            raise SystemExit(f"--levels: {level!r} is not a level this process runs ({', '.join(runnable)})")
        modules[level] = cpu_kernels.load(level)
        if modules[level] is None or not modules[level].gemv_supported():
            raise SystemExit(f"CPU kernels ({level}) without the quantized matmuls: {cpu_kernels.build_error(level)}")
    g = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args.shapes)
    weights = [torch.randn(n, k, generator=g) * 0.05 for _ in range(args.copies) for n, k in shapes]
    layers = {(level, fmt): build_layers(module, weights, fmt) for level, module in modules.items() for fmt in FORMATS}
    print(f"{args.shapes} shapes {shapes} x {args.copies}; {torch.get_num_threads()} threads; levels "
          f"{', '.join(f'{lvl} ({m.integer_dot()})' for lvl, m in modules.items())}", flush=True)

    results, table = [], []
    other = OtherLoad()
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g) for _, k in shapes}
        for fmt in FORMATS:
            best = dict.fromkeys(args.levels, float("inf"))
            for _ in range(args.rounds):
                for level in args.levels:
                    run = layers[(level, fmt)]
                    run[0](xs[weights[0].shape[1]])  # the first call of a round warms the thread pool
                    t0 = time.perf_counter()
                    for layer, w in zip(run, weights):
                        layer(xs[w.shape[1]])
                    best[level] = min(best[level], (time.perf_counter() - t0) / args.copies * 1e6)
            first = best[args.levels[0]]
            results.append({"rows": rows, "format": fmt, "us": {lvl: round(t, 1) for lvl, t in best.items()},
                            "speedup": {lvl: round(first / t, 3) for lvl, t in best.items()}})
            table.append([str(rows), fmt, *(f"{best[lvl]:.0f}" for lvl in args.levels),
                          *(f"{first / best[lvl]:.2f}x" for lvl in args.levels[1:])])
    print_table(["rows", "format", *(f"{lvl} us" for lvl in args.levels),
                 *(f"{lvl} / {args.levels[0]}" for lvl in args.levels[1:])], table, left=2)
    warning = busy_warning({"all": other.cores()})
    if warning:
        print(warning)
    write_report(args.output, "cpu_levels", {"levels": args.levels, "shapes": args.shapes, "copies": args.copies,
                                             "rounds": args.rounds,
                                             "integer_dot": {lvl: m.integer_dot() for lvl, m in modules.items()}},
                 results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
