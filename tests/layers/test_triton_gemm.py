"""The Triton weight-only GEMMs (tokenmill.layers.triton_gemm) against the fp32 matmul of the
weight their codes stand for, at shapes that are multiples of no tile; the CUDA kernel choice
of Int8Linear / Int4Linear by row count (a pure function of the rows and CUDA_GEMM_ROWS); and
benchmarks/cuda_quant_gemm.py's dry run. Without a GPU the kernels run in Triton's CPU
interpreter (tests/conftest.py) on float32; on a GPU compiled, on bf16."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers.linear import (  # noqa: E402
    ANY_ROWS,
    CUDA_GEMM_ROWS,
    CudaGemmRows,
    CudaKernel,
    Int4Linear,
    Int8Linear,
    cuda_int4_kernel,
    cuda_int8_kernel,
)
from tokenmill.layers.quantization.formats import dequantize_int4, pack_int4, quantize_int4, quantize_int8  # noqa: E402
from tokenmill.layers.triton_gemm import Blocks, blocks_for, int4_gemm, int8_gemm  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Blocks small enough that the shapes below take several tiles in every direction (the interpreter
# runs a tile as one numpy operation: a few tiles cost next to nothing).
SMALL = Blocks(max_rows=ANY_ROWS, block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)


def _data(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(DTYPE)
    return x, w


def _assert_close(y: torch.Tensor, ref: torch.Tensor):
    """fp32 in the interpreter: rounding only; bf16 on a GPU: a few bf16 ulps of the largest output."""
    assert y.shape == ref.shape
    err = (y.float().cpu() - ref).abs().max() / ref.abs().max()
    assert err <= (1e-5 if DTYPE == torch.float32 else 1e-2), err


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n, k, blocks", [(70, 200, None), (70, 200, SMALL), (33, 64, SMALL)])
def test_int8_gemm_is_the_matmul_of_the_dequantized_weight(m, n, k, blocks):
    x, w = _data(m, n, k, seed=m + n)
    codes, scales = quantize_int8(w)
    ref = x.float() @ (codes.float() * scales[:, None]).t()
    y = int8_gemm(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), blocks)
    _assert_close(y, ref)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group_size, k, blocks", [
    (32, 192, None), (64, 192, None),
    (32, 96, None),  # K a multiple of the group, not of any block_k in the table
    (64, 320, SMALL),  # 5 groups, 2 tiles of 32 each
    (32, 160, SMALL),
])
@pytest.mark.parametrize("interleave", [True, False])
def test_int4_gemm_is_the_matmul_of_the_dequantized_weight(m, group_size, k, blocks, interleave):
    n = 70
    x, w = _data(m, n, k, seed=m + k)
    codes, scales, mins = quantize_int4(w, group_size)
    zeros = mins + 8 * scales  # Int4Linear's (scale, zero) table: w = (code - 8) * scale + zero
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    ref = x.float() @ dequantize_int4(codes - 8, scales, zeros).t()
    if DEVICE == "cuda":  # the table in bf16, as Int4Linear keeps it
        sz = sz.to(torch.bfloat16)
        ref = x.float() @ dequantize_int4(codes - 8, sz[..., 0].float().t(), sz[..., 1].float().t()).t()
    y = int4_gemm(x.to(DEVICE), pack_int4(codes).to(DEVICE), sz.to(DEVICE), group_size, blocks, interleave)
    _assert_close(y, ref)


def test_the_block_table_covers_every_row_count_and_grows_with_it():
    assert [blocks_for(m).block_m for m in (1, 16, 17, 64, 65, 10**6)] == [16, 16, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="block_n"):
        Blocks(max_rows=1, block_m=16, block_n=24, block_k=32, num_warps=4, num_stages=2)


def test_int8_cuda_kernel_follows_the_table():
    t = CudaGemmRows(int8_torch_max_rows=16, int8_triton_max_rows=255, int8_int_mm_min_rows=128)
    picks = {m: cuda_int8_kernel(m, t) for m in (1, 16, 17, 255, 256, 4096)}
    assert picks == {1: CudaKernel.TORCH, 16: CudaKernel.TORCH, 17: CudaKernel.TRITON, 255: CudaKernel.TRITON,
                     256: CudaKernel.DEQUANTIZED, 4096: CudaKernel.DEQUANTIZED}
    # int8 activations only where the layer allows them, and then from their min rows on
    assert [cuda_int8_kernel(m, t, int8_activations=True) for m in (16, 127, 128, 4096)] == [
        CudaKernel.TORCH, CudaKernel.TRITON, CudaKernel.INT_MM, CudaKernel.INT_MM]
    # empty ranges: no PyTorch kernel, Triton at every row count; or Triton never
    assert {cuda_int8_kernel(m, CudaGemmRows(int8_torch_max_rows=0, int8_triton_max_rows=ANY_ROWS)) for m in (1, 10**6)} == {CudaKernel.TRITON}
    assert cuda_int8_kernel(17, CudaGemmRows(int8_torch_max_rows=16, int8_triton_max_rows=16)) is CudaKernel.DEQUANTIZED
    assert cuda_int8_kernel(1, CUDA_GEMM_ROWS) is CudaKernel.TORCH


def test_int4_cuda_kernel_follows_the_table_and_the_shape():
    t = CudaGemmRows(int4_tinygemm_max_rows=16)
    assert [cuda_int4_kernel(m, t) for m in (1, 16, 17, 4096)] == [CudaKernel.TORCH] * 2 + [CudaKernel.TRITON] * 2
    # a shape tinygemm refuses: Triton at every row count (on the packed codes, no bf16 copy)
    assert {cuda_int4_kernel(m, t, tinygemm_fits=False) for m in (1, 4096)} == {CudaKernel.TRITON}
    # a group size Triton cannot take: tinygemm at every row count, or the bf16 copy if it cannot either
    assert {cuda_int4_kernel(m, t, triton_fits=False) for m in (1, 4096)} == {CudaKernel.TORCH}
    assert cuda_int4_kernel(1, t, tinygemm_fits=False, triton_fits=False) is CudaKernel.DEQUANTIZED
    assert cuda_int4_kernel(1, CudaGemmRows(int4_tinygemm_max_rows=0)) is CudaKernel.TRITON


def test_the_table_rejects_a_negative_threshold():
    with pytest.raises(ValueError, match="int8_triton_max_rows"):
        CudaGemmRows(int8_triton_max_rows=-1)


def _benchmark_module():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its `common`
    try:
        spec = importlib.util.spec_from_file_location("cuda_quant_gemm", BENCHMARKS / "cuda_quant_gemm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_benchmark_recommends_the_fastest_thresholds():
    m = _benchmark_module()
    rows = [1, 4, 16, 64, 256, 1024]
    fastest = {"int8_torch": (1, 4, 16), "int8_triton": (64, 256), "int8_dequantized": (1024,),
               "int4_tinygemm": (1, 4), "int4_triton": (16, 64, 256, 1024), "int4_triton_shift": ()}
    total = {name: {r: 1.0 if r in best else 2.0 for r in rows} for name, best in fastest.items()}
    total["int8_int_mm"] = {r: 0.5 if r >= 256 else 3.0 for r in rows}
    assert m.recommend(total, rows) == CudaGemmRows(int8_torch_max_rows=16, int8_triton_max_rows=256,
                                                    int8_int_mm_min_rows=256, int4_tinygemm_max_rows=4)
    total["int8_int_mm"] = {r: 3.0 for r in rows}  # never faster: never chosen
    assert m.recommend(total, rows).int8_int_mm_min_rows == ANY_ROWS


def test_the_benchmark_dry_run_writes_a_report(tmp_path):
    out = tmp_path / "cuda_quant_gemm.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "cuda_quant_gemm.py"), "--dry-run", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "cuda_quant_gemm" and report["device"] and report["config"]["dry_run"]
    CudaGemmRows(**report["recommended"])  # the table's own fields
    kernels = {r["kernel"] for r in report["results"]}
    assert {"bf16", "int8_triton", "int4_triton", "int4_triton_shift", "int8_dequantized"} <= kernels
    assert all("error" not in r and r["max_rel_err"] < 0.03 for r in report["results"] if r["kernel"] != "int8_int_mm")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("n", [96, 100])  # 100: not tinygemm's shape (nor _int_mm's)
def test_cuda_layers_run_the_table_kernel_at_each_row_count(n):
    x_all, w = _data(300, n, 128, seed=n)
    codes, scales = quantize_int8(w)
    c4, s4, m4 = quantize_int4(w, 32)
    record4 = {"codes": pack_int4(c4).cuda(), "scales": s4.cuda(), "mins": m4.cuda()}
    table = CudaGemmRows(int8_torch_max_rows=4, int8_triton_max_rows=64, int8_int_mm_min_rows=128, int4_tinygemm_max_rows=4)
    layer8 = Int8Linear({"codes": codes.cuda(), "scales": scales.cuda()}, None, cuda_rows=table)
    layer8a = Int8Linear({"codes": codes.cuda(), "scales": scales.cuda()}, None, int8_activations=True, cuda_rows=table)
    layer4 = Int4Linear(record4, None, cuda_rows=table)
    assert (layer4.packed is not None) == (n % 8 == 0) and layer4.codes is not None and layer4.dense_weight is None
    ref8 = x_all.float().cpu() @ (codes.float() * scales.bfloat16().float()[:, None]).t()
    sz = layer4.scales_and_zeros.float().cpu()
    ref4 = x_all.float().cpu() @ dequantize_int4(c4 - 8, sz[..., 0].t(), sz[..., 1].t()).t()
    with torch.inference_mode():
        for m in (1, 4, 5, 64, 65, 128, 300):  # each side of each threshold
            x = x_all[:m].cuda()
            _assert_close(layer8(x), ref8[:m])
            _assert_close(layer4(x), ref4[:m])
            # per-token int8 activations: within a step of int8 of the weight-only product
            err = (layer8a(x).float().cpu() - ref8[:m]).abs().max() / ref8[:m].abs().max()
            assert err <= 0.05, err
    # with tinygemm given no rows, only the Triton copy of the codes is made
    assert Int4Linear(record4, None, cuda_rows=CudaGemmRows(int4_tinygemm_max_rows=0)).packed is None
