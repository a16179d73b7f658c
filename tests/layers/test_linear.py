"""The weight formats of tokenmill.layers.quantization.formats and the layers of tokenmill.layers.linear
built from them, against plain fp32 matmuls."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.cpu_isa import host_isa, onednn_bf16
from tokenmill.layers.linear import DenseLinear, Fp8Linear, Int4Linear, Int8Linear, W8A8Linear, convert_linears, fp8_gemm_supported
from tokenmill.layers.quantization.formats import (
    dequantize_int4,
    dequantize_record,
    layer_group_size,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_rows_int8,
    record_from_rtn,
    unpack_int4,
)


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = _weight()
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and scales.shape == (w.shape[0],)
    err = (codes.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    # the largest magnitude of each row is exactly representable
    assert (codes.abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_error_is_at_most_half_a_step(group_size):
    w = _weight()
    codes, scales, mins = quantize_int4(w, group_size)
    assert codes.min() >= 0 and codes.max() <= 15
    step = scales.repeat_interleave(group_size, dim=1)
    assert ((dequantize_int4(codes, scales, mins) - w).abs() <= step / 2 + 1e-7).all()


def test_int4_reproduces_a_q4_1_grid_exactly():
    """Weights already on a 16-level grid per group of 32 spanning the group's min..max (what a
    Q4_1 GGUF tensor dequantizes to) come back unchanged: loading one loses nothing."""
    g = torch.Generator().manual_seed(1)
    n, k = 64, 128
    lo = torch.randn(n, k // 32, 1, generator=g) * 0.1
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 puts the group's min at 0 and its max at 15
    w = (q * d + lo).view(n, k)
    codes, scales, mins = quantize_int4(w, 32)
    assert torch.equal(codes.view(n, k // 32, 32), q.to(torch.int32))
    torch.testing.assert_close(dequantize_int4(codes, scales, mins), w, rtol=0, atol=1e-6)


def test_int4_group_size_falls_back_to_one_that_divides_the_layer():
    assert layer_group_size(576, 128) == 64  # SmolLM2's hidden size is 4.5 x 128
    assert layer_group_size(1536, 128) == 128
    assert layer_group_size(96, 128) == 32
    assert layer_group_size(576, 32) == 32
    with pytest.raises(ValueError, match="no int4 group size"):
        layer_group_size(100, 128)
    codes, scales, mins = quantize_int4(_weight(k=96), 128)
    assert scales.shape == (96, 3)


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.int32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(unpack_int4(packed), codes)


def test_fp8_round_trip_error_is_relative():
    """E4M3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself; with the row's
    absmax at 448, values below 2^-6 * scale are subnormal, with an absolute step of 2^-9 * scale."""
    w = _weight()
    codes, scales = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn
    back = codes.float() * scales[:, None]
    bound = w.abs() * 2**-4 + scales[:, None] * 2**-10 + 1e-9
    assert ((back - w).abs() <= bound).all()


def test_per_token_activation_int8_error_is_at_most_half_a_step():
    x = torch.randn(7, 128) * torch.linspace(0.1, 10, 7)[:, None]
    codes, scales = quantize_rows_int8(x)
    assert scales.shape == (7, 1)
    assert ((codes.float() * scales - x).abs() <= scales / 2 + 1e-6).all()


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "fp8"])
def test_records_dequantize_close_to_the_weight(method):
    w = _weight()
    record = record_from_rtn(method, w, 32)
    err = (dequantize_record(method, record) - w).abs().max().item()
    bound = {"int8": w.abs().max() / 254, "w8a8": w.abs().max() / 254, "int4": (w.max() - w.min()) / 30, "fp8": w.abs().max() / 16}[method]
    assert err <= bound + 1e-7
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on(record: dict, device: str) -> dict:
    return {name: t.to(device) for name, t in record.items()}


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: the many-row path (CPU: dequantized; CUDA: the Triton GEMM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device, n", [("cpu", 96), pytest.param("cuda", 96, marks=CUDA),
                                       pytest.param("cuda", 100, marks=CUDA)])  # 100: not tinygemm's shape
def test_quantized_linears_compute_their_dequantized_matmul(rows, dtype, device, n):
    w = _weight(n=n)
    bias = torch.randn(w.shape[0]) * 0.1
    x = torch.randn(rows, w.shape[1]).to(dtype)
    xb = x.to(torch.bfloat16).float()  # the kernels take bf16 activations
    with torch.inference_mode():
        codes, scales = quantize_int8(w)
        ref8 = F.linear(xb, codes.float() * scales.bfloat16().float()[:, None], bias)
        out8 = Int8Linear(_on(record_from_rtn("int8", w, 32), device), bias.to(dtype).to(device))(x.to(device)).cpu()
        c4, s4, m4 = quantize_int4(w, 32)
        # the kernel keeps scale and zero (= min + 8 * scale) in bf16
        s4b = s4.bfloat16().float()
        z4b = (m4 + 8 * s4).bfloat16().float()
        ref4 = F.linear(xb, dequantize_int4(c4 - 8, s4b, z4b), bias)
        layer4 = Int4Linear(_on(record_from_rtn("int4", w, 32), device), bias.to(dtype).to(device))
        out4 = layer4(x.to(device)).cpu()
    # On CUDA a shape tinygemm refuses (n = 100) runs the Triton GEMM on the packed codes: no dense copy.
    assert layer4.dense_weight is None
    assert (layer4.codes is not None) == (device == "cuda" and n % 8 != 0)
    assert out8.dtype == dtype and out4.dtype == dtype
    # bf16 outputs: |y| ~ 1, so a couple of bf16 ulps
    torch.testing.assert_close(out8.float(), ref8, rtol=0.02, atol=0.02)
    torch.testing.assert_close(out4.float(), ref4, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_matches_f_linear(dtype):
    w = _weight().to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    layer = DenseLinear(w, bias)
    # oneDNN's packed bf16 weight where oneDNN computes bf16 (AVX-512), F.linear below
    assert layer.packed == (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                            and onednn_bf16(host_isa()))
    for rows in (1, 7, 300):
        x = torch.randn(rows, w.shape[1]).to(dtype)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, w, bias))


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_is_the_int8_product_of_quantized_rows_and_weight(rows, dtype):
    w = _weight()
    bias = torch.randn(w.shape[0]) * 0.1
    x = (torch.randn(rows, w.shape[1]) * 2).to(dtype)
    record = record_from_rtn("w8a8", w, 32)
    record["input_scale"] = torch.linspace(0.5, 2, w.shape[1])  # a SmoothQuant-style scaling
    with torch.inference_mode():
        out = W8A8Linear(record, bias.to(dtype))(x)
        xq, xs = quantize_rows_int8(x.float() * record["input_scale"])
        ref = (xq.float() @ record["codes"].float().t()) * xs * record["scales"] + bias
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # and close to the full-precision product: each operand is within half a step of int8
    full = F.linear(x.float() * record["input_scale"], w, bias)
    assert (out.float() - full).abs().max() <= 0.05 * full.abs().max()


def test_w8a8_linear_below_vnni_multiplies_the_codes_in_fp32(monkeypatch):
    """Below avx512_bf16 (no VNNI) oneDNN's int8 matmul saturates its int16 pair sums: the layer
    multiplies the same codes in fp32 and matches the exact integer product."""
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    w = _weight()
    x = torch.randn(5, w.shape[1]) * 2
    record = record_from_rtn("w8a8", w, 32)
    layer = W8A8Linear(record, None)
    assert layer.float_codes_t is not None
    xq, xs = quantize_rows_int8(x)
    exact = (xq.long() @ record["codes"].long().t()).float() * xs * record["scales"]
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), exact, rtol=1e-6, atol=1e-5)


def test_fp8_linear_on_cpu_widens_the_weight():
    w = _weight()
    x = torch.randn(3, w.shape[1])
    record = record_from_rtn("fp8", w, 32)
    with torch.inference_mode():
        out = Fp8Linear(record, None)(x)
    torch.testing.assert_close(out, F.linear(x, dequantize_record("fp8", record)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_gemm_supported(torch.device("cuda"))),
                    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
def test_fp8_linear_scaled_mm_on_gpu():
    w = _weight(n=256, k=256).cuda()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    record = record_from_rtn("fp8", w, 32)
    layer = Fp8Linear(record, None)
    assert layer.scaled_mm
    with torch.inference_mode():
        out = layer(x).float()
    ref = F.linear(x.float(), dequantize_record("fp8", record))
    # the activations are E4M3 too: relative error per element 2^-4, summed over 256 products
    assert (out - ref).abs().max() <= 0.1 * ref.abs().max()


def test_convert_linears_swaps_every_linear_for_a_dense_one():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        ref = model(x)
        convert_linears(model)
        out = model(x)
    assert isinstance(model[0], DenseLinear) and isinstance(model[2], DenseLinear)
    torch.testing.assert_close(out, ref)
