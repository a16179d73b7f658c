"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen2 checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(the inverse frequencies [head_dim / 2], the factor cos and sin are scaled by), as
    transformers' `ROPE_INIT_FUNCTIONS` compute them for each rope_type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "freq_factors":  # a GGUF file's rope_freqs: llama.cpp divides each frequency by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling has {factors.numel()} frequency factors for head_dim {head_dim}")
        return inv_freq / factors, 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, yarn, "
                     "freq_factors)")


def _yarn(head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency blends its interpolated (divided by `factor`) and original value by a
    linear ramp over the dimensions between the beta_fast and beta_slow rotation counts; cos and sin
    are scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives it)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; `lookup` picks a step's rows once, every layer then
    rotates its queries and keys with them (`apply`). Computed on the CPU whatever the default
    device (also when a model is built on the meta device), moved with the model."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        inv_freq, attention_factor = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # Computed in fp32, cast to the model dtype, as the reference implementation does. The
        # first half of sin is negated: rotate_half(x) * sin == roll(x, half) * signed_sin.
        cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("signed_sin_cache", sin.to(dtype), persistent=False)
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> (cos, signed sin), each [num_tokens, 1, head_dim]."""
        return self.cos_cache[positions].unsqueeze(1), self.signed_sin_cache[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] (queries and keys together). Same ops, same rounding,
        as the reference `x * cos + rotate_half(x) * sin`."""
        cos, sin = cos_sin
        return x * cos + x.roll(self.half, -1) * sin
