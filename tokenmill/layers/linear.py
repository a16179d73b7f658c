"""Linear layers in the weight format that runs fastest on the device, swapped in for the model's
`nn.Linear`s once the weights are loaded (`convert_linears`); model code calls `self.qkv_proj(x)`
the same way whatever the format.

- `DenseLinear`: the checkpoint's dtype. bf16 on CPU keeps the weight pre-packed in oneDNN's
  blocked layout (about twice as fast as `F.linear` for the few-row matmuls of decode).
- `Int8Linear`: weight-only int8, one symmetric scale per output channel.
- `Int4Linear`: weight-only int4, asymmetric, one scale and minimum per group of `group_size`
  input channels. A Q4_1 GGUF tensor (groups of 32, codes 0..15 spanning each group's min..max)
  re-quantizes onto exactly its own grid at group size 32, so nothing is lost beyond the bf16
  rounding of the scales.

The weight-only kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) read a
quarter / an eighth of fp32's bytes, which is what decide batch-1 decode speed. They compute in
bf16 (fed fp32 they are many times slower), so activations are cast to bf16 around them. With
many rows the matmul is compute-bound and these kernels are slower than a bf16 matmul: above
`max_rows` rows, `Int8Linear` dequantizes its weight and runs a plain bf16 matmul instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATION_METHODS


def _bf16_packing_supported(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = weight.dtype == torch.bfloat16 and _bf16_packing_supported(weight.device)
        # The oneDNN layout is opaque: keep it out of state_dict / .to() (the model is converted
        # after it has reached its device and dtype).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (codes int8 [N, K], scales fp32 [N]);
    weight ≈ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 by round-to-nearest: returns (codes int32 [N, K] in 0..15,
    scales fp32 [N, K / group_size], mins fp32 [N, K / group_size]);
    weight ≈ codes * scale + min, group by group."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"quantization_group_size {group_size} does not divide a linear layer's {k} input features")
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return codes.view(n, k), scales, lo


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    groups = scales.shape[1]
    w = codes.view(n, groups, k // groups).float() * scales[..., None] + mins[..., None]
    return w.view(n, k)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = 16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_int8(weight)
        self.codes = codes.to(weight.device)
        self.scales = scales.to(device=weight.device, dtype=torch.bfloat16)
        self.bias = bias
        self.max_rows = max_rows

    def dequantized(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if xb.shape[0] <= self.max_rows:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.codes, self.scales)
        else:
            y = F.linear(xb, self.dequantized())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int):
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError("int4 weight-only linears run on the CPU only (CUDA: use int8)")
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        codes, scales, mins = quantize_int4(weight, group_size)
        # The kernel computes (code - 8) * scale + zero per group, from a [groups, N, 2] table.
        zeros = mins + 8 * scales
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def make_linear(linear: nn.Linear, quantization: str | None, group_size: int = 32) -> nn.Module:
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    if quantization is None:
        return DenseLinear(weight, bias)
    if quantization == "int8":
        return Int8Linear(weight, bias)
    if quantization == "int4":
        return Int4Linear(weight, bias, group_size)
    raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATION_METHODS)}")


def convert_linears(model: nn.Module, quantization: str | None = None, group_size: int = 32,
                    lm_head_quantization: str | None = "int8") -> None:
    """Replace every `nn.Linear` of `model` (already on its device, in its dtype) in place.
    With a quantization the LM head gets `lm_head_quantization` (its own choice: the head is
    a large share of a small model's bytes and the most sensitive matrix)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                method = quantization
                if quantization is not None and name == "lm_head":
                    method = lm_head_quantization
                setattr(parent, name, make_linear(child, method, group_size))
