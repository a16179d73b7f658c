"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen2 checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
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
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; `lookup` picks a step's rows once, every layer then
    rotates its queries and keys with them (`apply`)."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # Computed in fp32, cast to the model dtype, as the reference implementation does. The
        # first half of sin is negated: rotate_half(x) * sin == roll(x, half) * signed_sin.
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
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
