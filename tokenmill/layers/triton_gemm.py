"""Triton GEMMs of bf16 / fp16 activations by weight-only quantized weights, the weight
dequantized inside the K loop (never written out): the CUDA kernels of `layers.linear`'s
Int8Linear and Int4Linear for the row counts `linear.CUDA_GEMM_ROWS` gives them.

- `int8_gemm`: x [M, K] @ (codes int8 [N, K] * scales [N, 1]).T. Each K tile of codes is
  widened to x's dtype (exact: |code| <= 127) and multiplied on the tensor cores with fp32
  accumulation; the per-channel scale multiplies the accumulator once, at the end.
- `int4_gemm`: x [M, K] @ w.T with w = (code - 8) * scale + zero per group of `group_size`
  input channels (the record's codes, uint8 [N, K/2], code 2i in byte i's low nibble; the
  [groups, N, 2] (scale, zero) table tinygemm reads too). A K tile never spans two groups (its
  width divides the group size), so each tile is dequantized with one (scale, zero) per output
  channel before the dot.

Block sizes come from a fixed table by row count (`BLOCKS`), no autotuning: decode's few rows
take tiles of 16 rows and narrow, deep weight tiles (many programs over N, long reads per
program); prefill takes 64- and 128-row tiles. M, N and K need not be multiples of a block:
rows and output channels past the end are clamped to valid addresses when loaded and masked
when stored; int8's K is masked when it is not a multiple of the tile, int4's always is one.
Programs are ordered with the row blocks of one weight tile next to each other, so the blocks
that read the same weight tile run at about the same time and the weight is read from memory
about once.

Under Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) bfloat16 is not
supported: the launchers then pass x, the scales and the output as float32, as
`layers.attention.triton_kernels` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention.triton_kernels import interpreting

ANY_ROWS = 1 << 62


@dataclass(frozen=True)
class Blocks:
    """One entry of the block-size table: the tiles and launch parameters for up to `max_rows` rows."""

    max_rows: int
    block_m: int
    block_n: int
    block_k: int  # int4: at most the group size (a tile stays within one group)
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Blocks.{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")


# The first entry whose max_rows covers the row count. Chosen from common Triton GEMM practice
# (no GPU measurement behind the exact values): decode reads the weight once and is
# memory-bound, so tiles of 16 rows (tl.dot's smallest) with narrow, deep weight tiles (more
# programs over N, long reads each) and a deep pipeline; prefill is compute-bound, so the 64-
# and 128-square tiles of Triton's matmul tutorial configurations. Compiled by Triton 3.6 the
# kernels take at most 80 KB of shared memory at sm_90 (cp.async pipelines, wgmma) and 48 KB at
# sm_80-89, within a consumer GPU's ~100 KB.
# benchmarks/cuda_quant_gemm.py times the kernels as they are.
BLOCKS: tuple[Blocks, ...] = (
    Blocks(max_rows=16, block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4),
    Blocks(max_rows=64, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
    Blocks(max_rows=ANY_ROWS, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
)


def blocks_for(rows: int) -> Blocks:
    return next(b for b in BLOCKS if rows <= b.max_rows)


# M is not specialized on: prefill row counts change every step, and a specialization (M == 1,
# M % 16 == 0) would compile another variant of the kernel while serving.
@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n, offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w.T's tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + offs_n).to(tl.float32)[None, :]
    _store(y_ptr, acc, pid_m, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERLEAVE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n, offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    if INTERLEAVE:  # [BLOCK_N, BLOCK_K / 2] bytes, contiguous along K, each byte's two codes interleaved
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    else:  # [BLOCK_K, BLOCK_N]: each byte loaded for both of its codes, shifted to one
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * (K // 2) + (tl.arange(0, BLOCK_K) // 2)[:, None]
        shifts = (tl.arange(0, BLOCK_K) % 2) * 4
    sz_ptrs = sz_ptr + offs_n * 2  # group g's (scale, zero) of channel n at 2 (g N + n)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs)
        group = (k * BLOCK_K) // GROUP
        scale = tl.load(sz_ptrs + group * 2 * N).to(tl.float32)
        zero = tl.load(sz_ptrs + group * 2 * N + 1).to(tl.float32)
        shift = zero - 8.0 * scale  # (code - 8) * scale + zero, as tinygemm computes it, in one multiply-add
        packed = tl.load(w_ptrs)
        if INTERLEAVE:
            codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            w = tl.trans((codes * scale[:, None] + shift[:, None]).to(x.dtype))
        else:
            codes = ((packed >> shifts[:, None]) & 0xF).to(tl.float32)  # [BLOCK_K, BLOCK_N]
            w = (codes * scale[None, :] + shift[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
    _store(y_ptr, acc, pid_m, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile (pid_m, pid_n) and its row and channel offsets. Rows and
    channels past the end wrap around (mod M, mod N) to valid memory and their results are
    masked at the store (`_store`): no masks in the K loop."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    return pid_m, pid_n, offs_m, offs_n


@triton.jit
def _store(y_ptr, acc, pid_m, pid_n, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _activations(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x as the kernels take it, and whether it is upcast: float32 in the interpreter, else
    bf16 or fp16 as given (float32 cast to bf16, as PyTorch's weight-only kernels take it);
    unit stride along K."""
    assert x.dim() == 2, f"expected x [M, K], got {tuple(x.shape)}"
    upcast = interpreting()
    if upcast:
        x = x.float()
    elif x.dtype not in (torch.bfloat16, torch.float16):
        x = x.to(torch.bfloat16)
    return (x if x.stride(1) == 1 else x.contiguous()), upcast


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, blocks: Blocks | None = None) -> torch.Tensor:
    """x [M, K] @ (codes int8 [N, K] (contiguous) * scales [N][:, None]).T: [M, N] in x's 16-bit
    dtype (bf16 for float32 x; float32 under the interpreter). `blocks`: the tiles (default: the
    table's entry for M)."""
    x, upcast = _activations(x)
    m, k = x.shape
    n = codes.shape[0]
    assert codes.dtype == torch.int8 and codes.shape[1] == k and codes.is_contiguous(), "codes: int8 [N, K], contiguous"
    assert scales.shape == (n,), f"scales: [{n}], got {tuple(scales.shape)}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    b = blocks or blocks_for(m)
    grid = (triton.cdiv(m, b.block_m) * triton.cdiv(n, b.block_n),)
    _int8_gemm_kernel[grid](
        x, codes, scales.float() if upcast else scales, y, m, n, k, x.stride(0), y.stride(0),
        BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, EVEN_K=k % b.block_k == 0,
        PRECISION="ieee" if upcast else "tf32", num_warps=b.num_warps, num_stages=b.num_stages,
    )
    return y


# How the int4 kernel unpacks a tile of codes: True loads [N, K/2] bytes (vector loads along K)
# and interleaves each byte's two codes in registers (as vLLM's AWQ Triton kernel does with
# tl.interleave), then transposes the tile for the dot; False loads each byte once per code,
# straight into the dot's [K, N] tile, and shifts (as vLLM's fused-MoE int4 kernel does).
# benchmarks/cuda_quant_gemm.py times both ("int4_triton", "int4_triton_shift").
INT4_INTERLEAVE = True


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              blocks: Blocks | None = None, interleave: bool = INT4_INTERLEAVE) -> torch.Tensor:
    """x [M, K] @ w.T, w [N, K] = (code - 8) * scale + zero of each group of `group_size` input
    channels (a power of two >= 16 dividing K): codes uint8 [N, K/2] (contiguous; code 2i in
    byte i's low nibble, as formats.pack_int4), scales_and_zeros [K / group_size, N, 2]
    (contiguous; Int4Linear's table, tinygemm's layout). Returns [M, N] as int8_gemm does.
    `interleave`: INT4_INTERLEAVE's choice of unpacking."""
    x, upcast = _activations(x)
    m, k = x.shape
    n = codes.shape[0]
    assert codes.dtype == torch.uint8 and codes.shape[1] * 2 == k and codes.is_contiguous(), "codes: uint8 [N, K/2], contiguous"
    assert group_size >= 16 and group_size & (group_size - 1) == 0 and k % group_size == 0, \
        f"group_size must be a power of two >= 16 dividing K={k}, got {group_size}"
    assert scales_and_zeros.shape == (k // group_size, n, 2) and scales_and_zeros.is_contiguous(), \
        f"scales_and_zeros: [{k // group_size}, {n}, 2] contiguous, got {tuple(scales_and_zeros.shape)}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    b = blocks or blocks_for(m)
    block_k = min(b.block_k, group_size)  # divides the group size, hence K
    grid = (triton.cdiv(m, b.block_m) * triton.cdiv(n, b.block_n),)
    _int4_gemm_kernel[grid](
        x, codes, scales_and_zeros.float() if upcast else scales_and_zeros, y, m, n, k, x.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=block_k, INTERLEAVE=interleave,
        PRECISION="ieee" if upcast else "tf32", num_warps=b.num_warps, num_stages=b.num_stages,
    )
    return y
