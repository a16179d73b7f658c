"""The records of `layers.quantization.formats` laid out for the compiled CPU kernels
(csrc/cpu_gemv.cpp at avx512_bf16, csrc/cpu_gemv_avx2.cpp at avx2 to avx512_vnni): output
channels in tiles of `tile_width(kernels)`, and a GGUF file's two-level factors in the tables the
kernels read in place of bf16 scales. A layer of `layers.linear` that runs these kernels lays out
its record once, when it is built, and keeps no other copy of the codes."""

from __future__ import annotations

import torch

# Rows converted at a time when laying out int4 codes (the unpacked codes are 1-4 bytes a weight).
PACK_ROWS = 4096


def tile_width(kernels) -> int:
    """Output channels per tile of the kernels' int4 and int8 layouts: 16 at avx512_bf16 (int4 by
    512-bit vpdpbusd, int8 by vdpbf16ps), 8 at avx2 to avx512_vnni (vpmaddubsw or vpdpbusd)."""
    return 16 if kernels.native_bf16() else 8


def int8_tiles_fit(kernels, out_features: int, in_features: int) -> bool:
    """Whether `kernels.int8_tiled_linear` takes an int8 weight of this shape at the kernels'
    level: tiles of 16 output channels and pairs of input channels at avx512_bf16, tiles of 8
    and blocks of 32 input channels (x's int8 blocks) at avx2 to avx512_vnni."""
    if not kernels.gemv_supported() or out_features % tile_width(kernels):
        return False
    return in_features % (16 if kernels.native_bf16() else 32) == 0


def tiled_int8_layout(codes: torch.Tensor, width: int) -> torch.Tensor:
    """int8 codes [N, K] (N a multiple of `width`) in a level's tiled layout: output channels in
    tiles of `width`, and per tile and step of s = 32 / width input channels 32 bytes, byte
    s c + j of step p = code(width t + c, s p + j): [N/width, K/s, 32]. Width 16 (avx512_bf16,
    csrc/cpu_gemv.cpp): pairs for vdpbf16ps; width 8 (avx2, csrc/cpu_gemv_avx2.cpp): words of 4
    for vpmaddubsw against 4 broadcast codes of x."""
    n, k = codes.shape
    span = 32 // width
    return codes.view(n // width, width, k // span, span).permute(0, 2, 1, 3).reshape(n // width, k // span, 32).contiguous()


def tiled_int4_layout(codes: torch.Tensor, width: int) -> torch.Tensor:
    """A record's int4 codes (uint8 [N, K/2], code 2i in byte i's low nibble; N a multiple of
    `width`) in a level's tiled layout: output channels in tiles of `width`, and per tile and
    step of 8 input channels 4 `width` bytes, byte 4c + j = code(c, 8i + j) | code(c, 8i + 4 + j)
    << 4 for channel c of the tile (j < 4): each nibble half holds the channels' words of 4 input
    channels, as vpdpbusd (width 16, avx512_bf16) or vpmaddubsw (width 8, avx2 to avx512_vnni)
    takes them against 4 broadcast int8 codes of x (csrc/cpu_gemv_avx2.cpp). Returned as
    [N/width, K width/64, 32]."""
    n, k = codes.shape[0], codes.shape[1] * 2
    steps = k // 8
    out = torch.empty(n // width, steps, 4 * width, dtype=torch.uint8)
    for start in range(0, n, PACK_ROWS):
        part = codes[start : start + PACK_ROWS]
        tiles = part.shape[0] // width
        # [tile, c, i, h, j]: input channel 8i + 4h + j of channel c
        nibbles = torch.stack([part & 0xF, part >> 4], dim=-1).view(tiles, width, steps, 2, 4)
        words = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)  # [tile, c, i, j]
        out[start // width : start // width + tiles] = words.permute(0, 2, 1, 3).reshape(tiles, steps, 4 * width)
    return out.view(n // width, k * width // 64, 32)


def tiled_int4_pairs(scales: torch.Tensor, mins: torch.Tensor, width: int) -> torch.Tensor:
    """A record's scales and mins ([N, groups]) beside `tiled_int4_layout`'s codes: [N/width,
    groups, 2 width] bf16, per tile and group its `width` scales then its mins."""
    n, groups = scales.shape
    per_tile = torch.cat([scales.reshape(n // width, width, groups), mins.reshape(n // width, width, groups)], dim=1)
    return per_tile.transpose(1, 2).to(torch.bfloat16).contiguous()


def tiled_int4_super_blocks(factors: torch.Tensor, super_factors: torch.Tensor) -> torch.Tensor | None:
    """A Q4_K record's factors (uint8 [N, K/32, 2]: each group's 6-bit scale and min factor;
    float16 [N, K/256, 2]: each super-block's d and m, scale = d sc, min = m mn;
    models/gguf_blocks.py) in the AVX2 int4 kernel's table (csrc/cpu_gemv_avx2.cpp SuperBlocks),
    in place of the bf16 pairs: uint8 [N/8, K/256, 128], per tile of 8 output channels and
    super-block its 8 d (fp16), its 8 m, then its 128 factors f (per group of 32 the 8 channels'
    scale factors, then their min factors) in 96 bytes: f[i] % 16 in the low nibble of byte i
    (i < 64) or the high nibble of byte i - 64, f[i] // 16 at bits 2 (i // 32) of byte 64 + i % 32.
    None if a factor does not fit 6 bits."""
    n, groups = factors.shape[:2]
    if factors.max() >= 64:
        return None
    supers = groups // 8
    f = factors.reshape(n // 8, 8, supers, 8, 2).permute(0, 2, 3, 4, 1).reshape(n // 8, supers, 128)
    low = f[..., :64] & 15 | (f[..., 64:] & 15) << 4
    top = f >> 4
    high = top[..., :32] | top[..., 32:64] << 2 | top[..., 64:96] << 4 | top[..., 96:] << 6
    heads = super_factors.to(torch.float16).reshape(n // 8, 8, supers, 2).permute(0, 2, 3, 1).contiguous()
    return torch.cat([heads.view(torch.uint8).reshape(n // 8, supers, 32), low, high], dim=2).contiguous()


def tiled_int4_factors(factors: torch.Tensor, super_factors: torch.Tensor) -> torch.Tensor:
    """A Q4_K record's factors (uint8 [N, K/32, 2]: each group's scale and min factor; float16
    [N, K/256, 2]: each super-block's d and m, scale = d sc, min = m mn; models/gguf_blocks.py)
    in the AVX-512 BF16 int4 kernel's table (csrc/cpu_gemv.cpp kInt4FactorBytes), in place of the
    bf16 pairs: uint8 [N/16, K/256, 320], per tile of 16 output channels and super-block its 16 d
    and 16 m (fp16), then per group its 16 scale factors and 16 min factors, a byte each."""
    n, groups = factors.shape[:2]
    supers = groups // 8
    heads = super_factors.to(torch.float16).reshape(n // 16, 16, supers, 2).permute(0, 2, 3, 1).contiguous()
    per_group = factors.reshape(n // 16, 16, supers, 8, 2).permute(0, 2, 3, 4, 1).reshape(n // 16, supers, 256)
    return torch.cat([heads.view(torch.uint8).reshape(n // 16, supers, 64), per_group], dim=2).contiguous()


def tiled_int6_layout(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int6 record's codes (uint8 [N, K] 0..63; N a multiple of 8) in the kernel's tiles of 8
    output channels (csrc/cpu_gemv_avx2.cpp int6_tile): low [N/8, K/8, 32], the codes' low 4 bits as
    `tiled_int4_layout` lays out int4 codes at width 8 (byte 4c + j of step i: input channels 8i + j
    and 8i + 4 + j of channel c); high [N/8, K/16, 32], byte p of pair u the top 2 bits of low byte
    p's two codes in step 2u (bits 0-3: the low nibble's code, then the high nibble's) and in step
    2u + 1 (bits 4-7), a pair of steps being a group of 16 (the groups' scales: Int6Linear's
    tile_scales)."""
    n, k = codes.shape
    steps = k // 8
    low = tiled_int4_layout((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4), 8)
    out = torch.empty(n // 8, steps // 2, 32, dtype=torch.uint8)
    for start in range(0, n, PACK_ROWS):
        part = codes[start : start + PACK_ROWS] >> 4
        tiles = part.shape[0] // 8
        top = part.view(tiles, 8, steps, 2, 4)  # [tile, c, i, h, j]: input channel 8i + 4h + j of channel c
        quads = (top[:, :, :, 0] | (top[:, :, :, 1] << 2)).permute(0, 2, 1, 3).reshape(tiles, steps, 32)
        out[start // 8 : start // 8 + tiles] = quads[:, 0::2] | (quads[:, 1::2] << 4)
    return low, out


def tiled_int6_super_blocks(factors: torch.Tensor, super_factors: torch.Tensor) -> torch.Tensor:
    """A Q6_K record's factors (int8 [N, K/16]: each group's sc; float16 [N, K/256]: each
    super-block's d, scale = d sc; models/gguf_blocks.py) in the int6 kernel's table in place of
    the bf16 tile scales (csrc/cpu_gemv_avx2.cpp Int6SuperBlocks): uint8 [N/8, K/256, 144], per
    tile of 8 output channels and super-block the 8 channels' d (fp16), then per group of 16
    their 8 factors."""
    n, groups = factors.shape
    supers = groups // 16
    heads = super_factors.to(torch.float16).reshape(n // 8, 8, supers).transpose(1, 2).contiguous()
    per_group = factors.view(torch.uint8).reshape(n // 8, 8, supers, 16).permute(0, 2, 3, 1)  # [tile, super, group, c]
    return torch.cat([heads.view(torch.uint8).reshape(n // 8, supers, 16),
                      per_group.reshape(n // 8, supers, 128)], dim=2).contiguous()
