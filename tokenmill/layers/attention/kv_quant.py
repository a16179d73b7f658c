"""Per-token, per-head symmetric quantization of keys and values (`kv_cache_dtype` int8 / fp8).

Each KV head's vector of each token gets one float32 scale, amax / qmax, computed when the token
is written; nothing is calibrated and a block's earlier tokens are never re-scaled, so a slot can
be written once (or overwritten, as rejected drafts' slots are) on its own.
- int8: codes round(x / scale) in [-127, 127]; |x - dequantized| <= scale / 2 = amax / 254.
- fp8 (e4m3fn: 3 mantissa bits, max 448): codes x / scale cast to float8; the error is at most
  2^-4 of |x| for codes in the normal range (|code| >= 2^-6), and at most 2^-10 x scale below it.

A quantized layer cache is `(key_codes, value_codes, key_scales, value_scales)`: codes
`[num_blocks, block_size, num_kv_heads, head_dim]` in the code dtype, scales
`[num_blocks, block_size, num_kv_heads]` float32.
"""

from __future__ import annotations

import torch

# kv_cache_dtype (config) -> the dtype codes are stored in; "auto" stores the compute dtype.
KV_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# kv_cache_dtype -> a plain float dtype the cache stores instead of float32 compute's (no scales:
# written rounded, read widened; float16 is what llama.cpp's cache holds by default).
KV_STORE_DTYPES = {"float16": torch.float16}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] in code_dtype, scales [...] float32)."""
    qmax = _QMAX[code_dtype]
    x = x.float()
    scales = torch.linalg.vector_norm(x, float("inf"), dim=-1) / qmax  # amax / qmax
    # An all-zero vector has scale 0: divide by the smallest normal instead (codes 0, exact).
    # |y| <= qmax up to a float32 rounding, so no clamp: int8 rounds it to 127, and e4m3fn
    # rounds anything below 464 to 448.
    y = x / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    if code_dtype == torch.int8:
        y = y.round_()
    return y.to(code_dtype), scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> values [..., head_dim] in `dtype`.

    The product is taken in float32 and rounded once: on CPU that is also faster than a bf16
    multiply (25% at 256 tokens x 3 heads x 64, one thread)."""
    return codes.to(torch.float32).mul_(scales[..., None]).to(dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a float8 tensor's uint8 view: index_copy_ has no float8 kernel (torch 2.13, CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
