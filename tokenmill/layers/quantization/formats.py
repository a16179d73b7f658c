"""Quantized weight formats: round-to-nearest quantizers, their inverses, and the portable tensors
a quantized linear is stored as (in memory before packing for a kernel, and on disk).

A format's record is a dict of tensors, the same for every way of choosing its codes (plain
round-to-nearest here, AWQ / GPTQ / SmoothQuant in tokenmill/quantization/):

| method | record |
|---|---|
| int8 | codes int8 [N, K], scales fp32 [N]: w ≈ codes * scale of its row (symmetric, per output channel) |
| int4 | codes uint8 [N, K/2] (two 4-bit codes 0..15 per byte, even column in the low nibble), scales and mins fp32 [N, K/g]: w ≈ code * scale + min of its group of g input channels |
| int6 | codes uint8 [N, K] (0..63), scales fp32 [N, K/16]: w ≈ (code - 32) * scale of its group of 16 input channels (symmetric; a GGUF file's Q6_K tensors under quantization auto) |
| w8a8 | as int8; activations are quantized per token (per row) at run time |
| fp8  | codes float8_e4m3fn [N, K], scales fp32 [N]: w ≈ codes * scale of its row |

A GGUF file's Q4_K and Q6_K tensors bring their two-level factors as well (models/gguf_blocks.py),
which the AVX2 kernels read in place of the scales (fewer bytes a weight): an int4 record
`factors` uint8 [N, K/32, 2] and `super_factors` fp16 [N, K/256, 2] (scale = d sc, min = m mn);
an int6 record `factors` int8 [N, K/16] and `super_factors` fp16 [N, K/256] (scale = d sc). The
scales (and mins) beside them are exactly what they make.

Any record may carry `input_scale` fp32 [K]: the layer computes with x * input_scale (AWQ's
and SmoothQuant's per-input-channel scaling, whose inverse is folded into the weight).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Which linear gets which format (quantization/quantize.py's QuantConfig, the streaming load):
LM_HEAD = "lm_head"
AUTO = "auto"  # QuantConfig.method: each linear as its GGUF tensors are stored (models/gguf_blocks.py)
ROUTER_SUFFIXES = ("mlp.gate", "shared_expert_gate")  # kept dense: a mixture of experts' router and shared-expert gate


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (codes int8 [N, K], scales fp32 [N]);
    weight ≈ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int4_group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and min of asymmetric 4-bit codes spanning each row of `w` [..., g] from its min to its max."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    return ((hi - lo) / 15).clamp(min=1e-12), lo


def int4_codes(w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The nearest codes 0..15 of `w` [..., g] on the grid code * scale + min ([...] each)."""
    return torch.round((w - mins[..., None]) / scales[..., None]).clamp(0, 15)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 by round-to-nearest: returns (codes int32 [N, K] in 0..15,
    scales fp32 [N, K / g], mins fp32 [N, K / g]) with g = layer_group_size(K, group_size);
    weight ≈ codes * scale + min, group by group."""
    n, k = weight.shape
    group_size = layer_group_size(k, group_size)
    w = weight.float().view(n, k // group_size, group_size)
    scales, mins = int4_group_params(w)
    return int4_codes(w, scales, mins).to(torch.int32).view(n, k), scales, mins


def layer_group_size(in_features: int, group_size: int) -> int:
    """The int4 group size of a layer with `in_features` inputs: `group_size`, or the largest
    of 64, 32 below it that divides the inputs (SmolLM2's 576 = 4.5 x 128 takes 64; the int4
    kernel needs a power of two). Raises ValueError if none does."""
    for g in (group_size, 64, 32):
        if g <= group_size and in_features % g == 0:
            return g
    raise ValueError(f"no int4 group size <= {group_size} divides a linear layer's {in_features} input features")


INT6_GROUP = 16  # input channels per int6 scale (Q6_K's sub-block)


def quantize_int6(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 6-bit codes per group of 16 input channels by round-to-nearest: returns (codes
    uint8 [N, K] in 0..63, scales fp32 [N, K/16]); weight ≈ (codes - 32) * scale. The scale puts
    the group's most negative value at -32 or its largest at 31, whichever needs the larger step,
    so a group already on a grid of 64 levels around zero (a Q6_K sub-block's) keeps it."""
    n, k = weight.shape
    w = weight.float().view(n, k // INT6_GROUP, INT6_GROUP)
    scales = torch.maximum(-w.amin(dim=-1).clamp(max=0) / 32, w.amax(dim=-1).clamp(min=0) / 31).clamp(min=1e-12)
    codes = (torch.round(w / scales[..., None]).clamp(-32, 31) + 32).to(torch.uint8)
    return codes.view(n, k), scales


def dequantize_int6(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return ((codes.view(n, -1, INT6_GROUP).float() - 32) * scales[..., None]).view(n, k)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    groups = scales.shape[1]
    w = codes.view(n, groups, k // groups).float() * scales[..., None] + mins[..., None]
    return w.view(n, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> uint8 [N, K/2], even column in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 codes [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).to(torch.int32)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one scale per output channel (the row's absmax maps to 448): returns
    (codes float8_e4m3fn [N, K], scales fp32 [N]); weight ≈ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row (per token): returns (codes int8, scales fp32 [rows, 1])."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8), scales


def record_from_rtn(method: str, weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The round-to-nearest record of `weight` [N, K] (see the module docstring)."""
    if method in ("int8", "w8a8"):
        codes, scales = quantize_int8(weight)
        return {"codes": codes, "scales": scales}
    if method == "int4":
        codes, scales, mins = quantize_int4(weight, group_size)
        return {"codes": pack_int4(codes), "scales": scales, "mins": mins}
    if method == "int6":
        codes, scales = quantize_int6(weight)
        return {"codes": codes, "scales": scales}
    if method == "fp8":
        codes, scales = quantize_fp8(weight)
        return {"codes": codes, "scales": scales}
    raise ValueError(f"unknown quantization method {method!r}")


def dequantize_record(method: str, record: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight [N, K] a record stands for (input_scale not applied: the layer computes
    (x * input_scale) @ this.T)."""
    if method == "int4":
        return dequantize_int4(unpack_int4(record["codes"]), record["scales"], record["mins"])
    if method == "int6":
        return dequantize_int6(record["codes"], record["scales"])
    return record["codes"].float() * record["scales"][:, None]
