"""The linear-layer formats of tokenmill.layers.linear against plain fp32 matmuls."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    convert_linears,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
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


def test_int4_group_size_must_divide_input_features():
    with pytest.raises(ValueError, match="quantization_group_size 128"):
        quantize_int4(_weight(k=96), 128)


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 > Int8Linear.max_rows: the dequantized path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linears_compute_their_dequantized_matmul(rows, dtype):
    w = _weight()
    bias = torch.randn(w.shape[0]) * 0.1
    x = torch.randn(rows, w.shape[1]).to(dtype)
    xb = x.to(torch.bfloat16).float()  # the kernels take bf16 activations
    with torch.inference_mode():
        codes, scales = quantize_int8(w)
        ref8 = F.linear(xb, codes.float() * scales.bfloat16().float()[:, None], bias)
        out8 = Int8Linear(w, bias.to(dtype))(x)
        c4, s4, m4 = quantize_int4(w, 32)
        # the kernel keeps scale and zero (= min + 8 * scale) in bf16
        s4b = s4.bfloat16().float()
        z4b = (m4 + 8 * s4).bfloat16().float()
        ref4 = F.linear(xb, dequantize_int4(c4 - 8, s4b, z4b), bias)
        out4 = Int4Linear(w, bias.to(dtype), 32)(x)
    assert out8.dtype == dtype and out4.dtype == dtype
    # bf16 outputs: |y| ~ 1, so a couple of bf16 ulps
    torch.testing.assert_close(out8.float(), ref8, rtol=0.02, atol=0.02)
    torch.testing.assert_close(out4.float(), ref4, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_matches_f_linear(dtype):
    w = _weight().to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    layer = DenseLinear(w, bias)
    assert layer.packed == (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available())
    for rows in (1, 7, 300):
        x = torch.randn(rows, w.shape[1]).to(dtype)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, w, bias))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))
        self.lm_head = nn.Linear(32, 50, bias=False)


@pytest.mark.parametrize("quantization, body", [(None, DenseLinear), ("int8", Int8Linear), ("int4", Int4Linear)])
def test_convert_linears_swaps_every_linear(quantization, body):
    model = _Tiny()
    x = torch.randn(3, 64)
    with torch.inference_mode():
        ref = model.lm_head(model.block(x))
        convert_linears(model, quantization, group_size=32)
        out = model.lm_head(model.block(x))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.block[0], body) and isinstance(model.block[2], body)
    assert isinstance(model.lm_head, DenseLinear if quantization is None else Int8Linear)  # the head: int8
    tol = {None: 1e-5, "int8": 0.05, "int4": 0.2}[quantization]
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
