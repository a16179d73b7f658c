#!/usr/bin/env python
"""Weight-only int8 and int4 matmuls on CUDA: every kernel tokenmill's Int8Linear and Int4Linear
can run, timed on the linear shapes of Qwen2.5-1.5B and Llama-3.1-8B (qkv, o, gate_up, down) at
1-1024 rows, against a bf16 matmul; and the row thresholds of `layers.linear.CUDA_GEMM_ROWS`
that the times recommend.

    bf16              F.linear on the bf16 weight (the speed to beat)
    int8_torch        aten._weight_int8pack_mm (CUDA cores)
    int8_triton       triton_gemm.int8_gemm (dequant inside the K loop, tensor cores)
    int8_dequantized  codes * scales to bf16 per call, then F.linear (cuBLAS)
    int8_int_mm       activations to int8 per token, torch._int_mm (w8a8 numerics: an opt-in)
    int4_tinygemm     aten._weight_int4pack_mm (groups of --group-size)
    int4_triton       triton_gemm.int4_gemm on the record's packed codes, bytes unpacked by
                      tl.interleave; int4_triton_shift: by a load per code and a shift
                      (triton_gemm.INT4_INTERLEAVE picks the layers' one)

Each time is triton.testing.do_bench's median (the L2 cache flushed before every call, so the
weight comes from memory as in a model's decode step), GPU time per call; the candidates of
several kernels (int8_dequantized, int8_int_mm) include whatever gaps their launches leave.
Weight GB/s: the bytes of the weight as that kernel reads it (codes and scales) over the time.
Each output is also checked against the fp32 matmul of the weight the format stands for
(`max_rel_err`: the largest difference over the largest output), and the layers themselves run
once at rows that reach each kernel (`layer_checks`).

Recommended thresholds: for each field of CudaGemmRows, the value among 0 and the measured row
counts that makes the layers' own selection (`cuda_int8_kernel`, `cuda_int4_kernel`) fastest in
total over every shape and row count measured; "recommended" in the JSON has the table's fields,
so `CudaGemmRows(**report["recommended"])` is the measured table.

Without CUDA, or with --dry-run, tiny shapes run on the CPU through Triton's interpreter (wall
clock, no tinygemm), to test the script.

    python benchmarks/cuda_quant_gemm.py
    python benchmarks/cuda_quant_gemm.py --rows 1,16,256 --models llama-3.1-8b
    python benchmarks/cuda_quant_gemm.py --dry-run --output /tmp/cuda_quant_gemm.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

# Triton decides at a kernel's definition whether to interpret it: set before the kernels import.
if "--dry-run" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from common import RESULTS_DIR, device_name, fmt, print_table, write_report  # noqa: E402

from tokenmill.layers import triton_gemm  # noqa: E402
from tokenmill.layers.linear import (  # noqa: E402
    ANY_ROWS,
    CUDA_GEMM_ROWS,
    CUDA_INT_MM_MIN_ROWS,
    CudaGemmRows,
    CudaKernel,
    Int4Linear,
    Int8Linear,
    cuda_int4_kernel,
    cuda_int8_kernel,
    int8_activation_matmul,
)
from tokenmill.layers.quantization.formats import dequantize_int4, pack_int4, quantize_int4, quantize_int8  # noqa: E402

DEFAULT_OUTPUT = RESULTS_DIR / "cuda_quant_gemm.json"

# (out_features, in_features) of each model's linears; qkv and gate_up fused, as tokenmill runs them
MODELS = {
    "qwen2.5-1.5b": {"qkv": (1536 + 2 * 256, 1536), "o": (1536, 1536), "gate_up": (2 * 8960, 1536), "down": (1536, 8960)},
    "llama-3.1-8b": {"qkv": (4096 + 2 * 1024, 4096), "o": (4096, 4096), "gate_up": (2 * 14336, 4096), "down": (4096, 14336)},
}
# --dry-run: sizes the interpreter runs in a moment; N and K not multiples of the tiles
DRY_MODELS = {"tiny": {"a": (40, 64), "b": (24, 96)}}
DRY_ROWS = "1,17"

INT8_NAMES = {CudaKernel.TORCH: "int8_torch", CudaKernel.TRITON: "int8_triton",
              CudaKernel.DEQUANTIZED: "int8_dequantized", CudaKernel.INT_MM: "int8_int_mm"}
INT4_NAMES = {CudaKernel.TORCH: "int4_tinygemm",
              CudaKernel.TRITON: "int4_triton" if triton_gemm.INT4_INTERLEAVE else "int4_triton_shift"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"models whose linear shapes to time, of {','.join(MODELS)}")
    p.add_argument("--rows", default="1,4,16,64,256,1024", help="row counts (tokens), comma-separated")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (tokenmill's default: 32)")
    p.add_argument("--rep-ms", type=int, default=10, help="do_bench's time budget per measurement, ms")
    p.add_argument("--dry-run", action="store_true",
                   help=f"tiny shapes at rows {DRY_ROWS} on the CPU through Triton's interpreter (the default without CUDA)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json", help="JSON report")
    return p.parse_args(argv)


def time_ms(fn, device: str, rep_ms: int) -> float:
    """Median ms per call of `fn` (already run once: compiled, warm)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class Weight:
    """One random linear weight [N, K] in every format, and each candidate's callable, bytes read
    and fp32 reference weight."""

    def __init__(self, n: int, k: int, group_size: int, device: str, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        codes8, scales8 = quantize_int8(w)
        scales8 = scales8.to(torch.bfloat16)  # as Int8Linear keeps them
        c4, s4, m4 = quantize_int4(w, group_size)
        codes4 = pack_int4(c4)
        # Int4Linear's (scale, zero) table: w = (code - 8) * scale + zero
        sz = torch.stack([s4.t(), (m4 + 8 * s4).t()], dim=-1).to(torch.bfloat16).contiguous()
        self.refs = {
            "bf16": w.float(),
            "int8": codes8.float() * scales8.float()[:, None],
            "int4": dequantize_int4(c4 - 8, sz[..., 0].float().t(), sz[..., 1].float().t()),
        }
        bytes8 = codes8.numel() + scales8.numel() * 2
        bytes4 = codes4.numel() + sz.numel() * 2
        self.candidates = {
            "bf16": (lambda x: F.linear(x, w), w.numel() * 2, "bf16"),
            "int8_torch": (lambda x: torch.ops.aten._weight_int8pack_mm(x, codes8, scales8), bytes8, "int8"),
            "int8_triton": (lambda x: triton_gemm.int8_gemm(x, codes8, scales8), bytes8, "int8"),
            "int8_dequantized": (lambda x: F.linear(x, codes8.to(torch.bfloat16) * scales8[:, None]), bytes8, "int8"),
            "int8_int_mm": (lambda x: int8_activation_matmul(x, codes8.t(), scales8, CUDA_INT_MM_MIN_ROWS), bytes8, "int8"),
            "int4_triton": (lambda x: triton_gemm.int4_gemm(x, codes4, sz, group_size, interleave=True), bytes4, "int4"),
            "int4_triton_shift": (lambda x: triton_gemm.int4_gemm(x, codes4, sz, group_size, interleave=False),
                                  bytes4, "int4"),
        }
        if device == "cuda":
            # tinygemm's layout, made as Int4Linear makes it (a table giving tinygemm every row count)
            record = {"codes": codes4, "scales": s4, "mins": m4}
            layer = Int4Linear(record, None, cuda_rows=CudaGemmRows(int4_tinygemm_max_rows=ANY_ROWS))
            packed, layer_sz = layer.packed, layer.scales_and_zeros
            self.candidates["int4_tinygemm"] = (
                lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group_size, layer_sz), bytes4, "int4")


def measure_shape(model: str, layer: str, n: int, k: int, rows: list[int], args, device: str, seed: int) -> list[dict]:
    weight = Weight(n, k, args.group_size, device, seed)
    results = []
    for m in rows:
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        expected = {fmt_name: x.float() @ ref.t() for fmt_name, ref in weight.refs.items()}
        for name, (fn, num_bytes, fmt_name) in weight.candidates.items():
            row = {"model": model, "layer": layer, "n": n, "k": k, "rows": m, "kernel": name}
            try:
                y = fn(x).float()  # compiles a Triton kernel on its first call
                ref = expected[fmt_name]
                row["max_rel_err"] = ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
                ms = time_ms(lambda: fn(x), device, args.rep_ms)
                row.update(ms=ms, weight_gb_s=num_bytes / ms / 1e6)
            except Exception as exc:  # noqa: BLE001 (a kernel that fails here is reported, the rest still run)
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            results.append(row)
        del expected
    del weight
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def totals(results: list[dict]) -> dict[str, dict[int, float]]:
    """Per kernel and row count, the summed ms over the shapes; inf where any shape failed."""
    out: dict[str, dict[int, float]] = {}
    for r in results:
        per_rows = out.setdefault(r["kernel"], {})
        per_rows[r["rows"]] = per_rows.get(r["rows"], 0.0) + r.get("ms", float("inf"))
    return out


def table_cost(total: dict[str, dict[int, float]], rows: list[int], table: CudaGemmRows) -> dict[str, float]:
    """Total ms over every measured row count of the kernels the table selects: int8
    weight-only, int8 with int8 activations allowed, int4 (tinygemm taking the shapes)."""
    missing = {}

    def cost(names, select) -> float:
        return sum(total.get(names[select(m)], missing).get(m, float("inf")) for m in rows)

    return {
        "int8": cost(INT8_NAMES, lambda m: cuda_int8_kernel(m, table)),
        "int8_activations": cost(INT8_NAMES, lambda m: cuda_int8_kernel(m, table, int8_activations=True)),
        "int4": cost(INT4_NAMES, lambda m: cuda_int4_kernel(m, table)),
    }


def recommend(total: dict[str, dict[int, float]], rows: list[int]) -> CudaGemmRows:
    """The table whose selection is fastest in total over the measured row counts, each max
    threshold among 0 and those row counts (int_mm's min among them, or never)."""
    cuts = [0, *sorted(rows)]
    int8 = min((CudaGemmRows(int8_torch_max_rows=a, int8_triton_max_rows=b) for a in cuts for b in cuts if b >= a),
               key=lambda t: table_cost(total, rows, t)["int8"])
    int8 = min((replace(int8, int8_int_mm_min_rows=r) for r in [*sorted(rows), ANY_ROWS]),
               key=lambda t: table_cost(total, rows, t)["int8_activations"])
    return min((replace(int8, int4_tinygemm_max_rows=c) for c in cuts),
               key=lambda t: table_cost(total, rows, t)["int4"])


def layer_checks(device: str) -> list[dict]:
    """Int8Linear and Int4Linear on CUDA, as the model builds them, at row counts that reach each
    kernel of the current table: the largest difference from the fp32 matmul of the weight the
    format stands for, over the largest output. N 1000 and K 800 are multiples of no tile; N
    1004 is not tinygemm's shape (Triton at every row count) nor _int_mm's."""
    if device != "cuda":
        return []
    table = CUDA_GEMM_ROWS
    rows = sorted({1, table.int8_torch_max_rows + 1, table.int8_triton_max_rows + 1, table.int8_int_mm_min_rows,
                   table.int4_tinygemm_max_rows + 1} - {ANY_ROWS, ANY_ROWS + 1})
    out = []
    for n in (1000, 1004):
        weight = Weight(n, 800, 32, device, seed=n)
        codes8, scales8 = quantize_int8(weight.refs["bf16"])
        c4, s4, m4 = quantize_int4(weight.refs["bf16"], 32)
        record4 = {"codes": pack_int4(c4), "scales": s4, "mins": m4}
        layers = [("int8", Int8Linear({"codes": codes8, "scales": scales8}, None), False),
                  ("int8", Int8Linear({"codes": codes8, "scales": scales8}, None, int8_activations=True), True),
                  ("int4", Int4Linear(record4, None), False)]
        for fmt_name, layer, activations in layers:
            for m in rows:
                if fmt_name == "int8":
                    kernel = cuda_int8_kernel(m, table, layer.int8_activations)
                else:
                    kernel = cuda_int4_kernel(m, table, layer.tinygemm_fits, layer.triton_fits)
                row = {"format": fmt_name, "n": n, "k": 800, "rows": m, "int8_activations": activations, "kernel": kernel.value}
                x = torch.randn(m, 800, device=device).to(torch.bfloat16)
                try:
                    y = layer(x).float()
                    ref = x.float() @ weight.refs[fmt_name].t()
                    row["max_rel_err"] = ((y - ref).abs().max() / ref.abs().max()).item()
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                out.append(row)
    return out


def print_shape(title: str, results: list[dict], rows: list[int]) -> None:
    """µs per call, and at the first row count the weight GB/s, of each kernel."""
    names = list(dict.fromkeys(r["kernel"] for r in results))
    cell = {(r["rows"], r["kernel"]): r for r in results}
    us = lambda m, name: fmt(cell[m, name]["ms"] * 1e3 if "ms" in cell[m, name] else None)  # noqa: E731
    print(f"\n{title}: µs per call (weight GB/s at {rows[0]} rows)")
    print_table(["rows", *names], [[str(m), *(us(m, name) for name in names)] for m in rows]
                + [[f"GB/s@{rows[0]}", *(fmt(cell[rows[0], name].get("weight_gb_s"), ".0f") for name in names)]])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; known: {','.join(MODELS)}")
    models = DRY_MODELS if device == "cpu" else {m: MODELS[m] for m in args.models.split(",")}
    rows = [int(r) for r in (DRY_ROWS if device == "cpu" else args.rows).split(",")]
    print(f"device: {device_name(device)}; interpreter: {triton_gemm.interpreting()}")
    t0 = time.perf_counter()
    results = []
    with torch.inference_mode():
        for model, layers in models.items():
            for seed, (layer, (n, k)) in enumerate(layers.items()):
                shape_results = measure_shape(model, layer, n, k, rows, args, device, seed)
                results += shape_results
                print_shape(f"{model} {layer} (N={n}, K={k})", shape_results, rows)
        checks = layer_checks(device)
    total = totals(results)
    recommended = recommend(total, rows)
    print("\nall shapes, ms per row count:")
    print_table(["kernel", *map(str, rows)], [[name, *(fmt(per_rows.get(m), ".3f") for m in rows)] for name, per_rows in total.items()])
    costs = {"current": table_cost(total, rows, CUDA_GEMM_ROWS), "recommended": table_cost(total, rows, recommended)}
    print(f"\ncurrent table:     {asdict(CUDA_GEMM_ROWS)} -> ms {costs['current']}")
    print(f"recommended table: {asdict(recommended)} -> ms {costs['recommended']}")
    if checks:
        print("\nlayer checks (max_rel_err against the fp32 matmul):")
        print_table(["format", "n", "rows", "int8 act", "kernel", "max_rel_err"],
                    [[c["format"], str(c["n"]), str(c["rows"]), str(c["int8_activations"]), c["kernel"],
                      c.get("error", fmt(c.get("max_rel_err"), ".4f"))] for c in checks], left=5)
    bad = [r for r in results if "error" in r or r["max_rel_err"] > (0.1 if r["kernel"] == "int8_int_mm" else 0.03)]
    bad += [c for c in checks if "error" in c or c["max_rel_err"] > (0.1 if c["int8_activations"] else 0.03)]
    for r in bad:
        print(f"CHECK: {r}")
    seconds = time.perf_counter() - t0
    print(f"{len(results)} measurements, {len(checks)} layer checks, {len(bad)} to check; {seconds:.1f} s")
    config = {"models": list(models), "rows": rows, "group_size": args.group_size, "rep_ms": args.rep_ms,
              "dry_run": device == "cpu", "blocks": [asdict(b) for b in triton_gemm.BLOCKS]}
    write_report(args.output, "cuda_quant_gemm", config, results, device=device_name(device),
                 recommended=asdict(recommended), current=asdict(CUDA_GEMM_ROWS), table_ms=costs,
                 layer_checks=checks, failures=len(bad), seconds=seconds)


if __name__ == "__main__":
    main()
