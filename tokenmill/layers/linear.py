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
`max_rows` rows, `Int8Linear` runs the compiled `int8_gemm` (0.85-1.34x the time of oneDNN's
bf16 matmul, 2.1-2.5x faster than PyTorch's int8 kernel at 64 rows), or without the kernels
dequantizes its weight and runs a plain bf16 matmul.

Given the compiled CPU kernels (`layers.cpu_kernels`, on a CPU with AVX-512 BF16), the bf16
and int8 layers run matmuls of 1-3 rows — decode steps of a few requests — with tokenmill's own
`bf16_linear` / `int8_linear` (csrc/cpu_gemv.cpp), which read the weight at close to memory
speed where PyTorch's kernels do not (1.3-1.6x on the default model's matrices at 1 row); more
rows keep PyTorch's kernels, except many rows of int8 (above `max_rows`: `int8_gemm`), at a bf16
matmul's speed. The int4 layer runs tokenmill's `int4_linear` at every row count (one kernel over
a layout of its own, `layers.quantization.cpu_layouts`, without PyTorch's packed copy).

On CUDA the int8 and int4 layers choose a kernel per call by row count (`cuda_int8_kernel`,
`cuda_int4_kernel`), from the thresholds of one table, `CUDA_GEMM_ROWS`: PyTorch's weight-only
kernel for decode's few rows, the Triton GEMM that dequantizes the weight inside its K loop
(`layers.triton_gemm`) above, and for int8 with many rows the weight dequantized to bf16 and a
cuBLAS matmul.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATION_METHODS
from tokenmill.cpu_isa import host_isa, onednn_bf16, onednn_int8_exact
from tokenmill.layers.quantization.cpu_layouts import (
    PACK_ROWS, int8_tiles_fit, tile_width, tiled_int4_factors, tiled_int4_layout, tiled_int4_pairs,
    tiled_int4_super_blocks, tiled_int6_layout, tiled_int6_super_blocks, tiled_int8_layout,
)
from tokenmill.layers.quantization.formats import FP8_MAX, dequantize_int4, dequantize_int6, quantize_rows_int8, unpack_int4


# The most rows the bf16 and int8 few-row kernels take here and in the DecoderStack at avx512_bf16.
KERNEL_MAX_ROWS = 3
# `int4_linear` takes every row count at every level (one kernel over a tiled layout): its row
# limit in the DecoderStack.
ANY_ROWS = 1 << 62
# At avx2 to avx512_vnni the int8 few-row kernel (int8 activations, memory-bound) runs up to this many
# rows and the fp32 panel kernel (int8_gemm) above; PyTorch's bf16 kernels never (without native
# bf16 they are many times slower than either).
AVX2_KERNEL_MAX_ROWS = 8


def kernel_rows(kernels) -> tuple[int, int]:
    """(the most rows for the few-row kernels, the fewest for the many-row ones) of a kernels
    module (at avx512_bf16 Int8Linear's many-row rule is its own `max_rows`)."""
    if kernels.native_bf16():
        return KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1
    return AVX2_KERNEL_MAX_ROWS, AVX2_KERNEL_MAX_ROWS + 1


def _bf16_packing_supported(device: torch.device) -> bool:
    # oneDNN's bf16 weight packing needs AVX-512 (BW/VL/DQ); below it F.linear computes bf16 (slowly).
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and onednn_bf16(host_isa())


class DenseLinear(nn.Module):
    """The checkpoint's dtype. With `kernels` (the compiled CPU kernels, on a CPU with AVX-512
    BF16) and bf16 weights whose in_features are a multiple of 32, matmuls of 1-3 rows run
    `kernels.bf16_linear` (csrc/cpu_gemv.cpp) on the plain weight, which this layer then keeps
    as well as the packed one (a tied LM head's plain weight is the embedding itself)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = weight.dtype == torch.bfloat16 and _bf16_packing_supported(weight.device)
        self.kernel = None
        if (self.packed and kernels is not None and kernels.native_bf16() and self.in_features % 32 == 0
                and weight.is_contiguous()):
            self.kernel, self.plain = kernels, weight
        # The oneDNN layout is opaque: keep it out of state_dict / .to() (the model is converted
        # after it has reached its device and dtype).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= KERNEL_MAX_ROWS and x.dtype == torch.bfloat16:
            return self.kernel.bf16_linear(x.contiguous(), self.plain, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def cpu_decoder_spec(self) -> tuple | None:
        """This layer for the compiled `DecoderStack` (csrc/cpu_decoder.cpp), which runs the same
        kernels by the same row rule: (kind, weight, scales, bias, input_scale, param, kernel
        weight, kernel pairs, kernel_max_rows); the kernel weight and pairs are the few-row
        kernel's (`bf16_linear`: the plain weight; `int4_linear`: Int4Linear's codes and pairs,
        every row count) or None, up to kernel_max_rows rows (0: none). None where it cannot."""
        return ("onednn" if self.packed else "dense", self.weight, None, self.bias, None, 0,
                self.plain if self.kernel is not None else None, None,
                KERNEL_MAX_ROWS if self.kernel is not None else 0)


class QuantizedLinear(nn.Module):
    """A linear layer built from a quantized record (`tokenmill.layers.quantization.formats`):
    y = matmul(x * input_scale) + bias, in x's dtype. Subclasses implement `_matmul`."""

    def __init__(self, record: dict[str, torch.Tensor], bias: torch.Tensor | None, input_scale_dtype: torch.dtype):
        super().__init__()
        self.out_features = record["scales"].shape[0]
        # A buffer, so that a cast of the model to the compute dtype reaches it; the record's
        # tensors are plain attributes, in the formats their kernels need whatever that dtype.
        self.register_buffer("bias", bias)
        scale = record.get("input_scale")
        self.input_scale = None if scale is None else scale.to(input_scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x if self.input_scale is None else x * self.input_scale)
        if self.bias is not None:
            y = y + self.bias
        # (a dtype test costs far less than the dispatch of a no-op .to, ~1 us, 2 per linear)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cpu_decoder_spec(self) -> tuple | None:
        """As DenseLinear's; the weight-only int8 and int4 layers have one."""
        return None


class CudaKernel(enum.Enum):
    """What runs a weight-only int8 / int4 layer's matmul on CUDA."""

    TORCH = "torch"  # PyTorch's weight-only kernel: _weight_int8pack_mm (no tensor cores) / tinygemm's _weight_int4pack_mm
    TRITON = "triton"  # layers.triton_gemm: the weight dequantized inside the K loop, tensor-core dots
    DEQUANTIZED = "dequantized"  # int8: the weight dequantized to bf16 per call, F.linear; int4: a bf16 copy kept
    INT_MM = "int_mm"  # int8: activations quantized per token, torch._int_mm (w8a8 numerics: opt-in)


@dataclass(frozen=True)
class CudaGemmRows:
    """Row-count thresholds of the weight-only layers' kernels on CUDA (`cuda_int8_kernel`,
    `cuda_int4_kernel`). A kernel's range may be empty (a max of 0, or no higher than the max
    before it); ANY_ROWS stands for every row count.

    The defaults are not measured here; they follow public practice: PyTorch's weight-only
    kernels (gpt-fast's int8 and tinygemm int4) are made for batch-1 decode and lose to tensor
    cores beyond a few rows, so they take up to 16; a fused dequant-in-the-loop GEMM beats
    dequantize-then-matmul while the matmul is not compute-bound (vLLM's AWQ layer switches to
    dequantize + matmul from 256 tokens), so Triton up to 255 rows. `benchmarks/cuda_quant_gemm.py`
    times every candidate on the GPU at 1-1024 rows and writes the thresholds it recommends into
    its JSON report ("recommended"), field for field."""

    int8_torch_max_rows: int = 16  # _weight_int8pack_mm up to this many rows
    int8_triton_max_rows: int = 255  # the Triton GEMM up to this many; dequantize + F.linear above
    # From this many rows torch._int_mm on activations quantized per token, where a layer allows
    # it (Int8Linear(int8_activations=True)): int8 tensor cores at twice the bf16 rate pay for the
    # quantization's extra passes once the matmul is compute-bound.
    int8_int_mm_min_rows: int = 128
    # tinygemm up to this many rows where the shape fits it, the Triton GEMM above. Every row count
    # by default: a layer whose kernels split the rows keeps the codes in both layouts (a byte a
    # weight instead of half), which only a measured prefill gain would pay for.
    int4_tinygemm_max_rows: int = ANY_ROWS

    def __post_init__(self):
        for name in ("int8_torch_max_rows", "int8_triton_max_rows", "int8_int_mm_min_rows", "int4_tinygemm_max_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CudaGemmRows.{name} must be an int >= 0, got {value!r}")


CUDA_GEMM_ROWS = CudaGemmRows()


def cuda_int8_kernel(rows: int, table: CudaGemmRows = CUDA_GEMM_ROWS, int8_activations: bool = False) -> CudaKernel:
    """The kernel of an int8 layer's matmul of `rows` rows on CUDA: _int_mm where allowed from
    its min rows; else PyTorch's up to its max, Triton up to its max, dequantized above."""
    if int8_activations and rows >= table.int8_int_mm_min_rows:
        return CudaKernel.INT_MM
    if rows <= table.int8_torch_max_rows:
        return CudaKernel.TORCH
    if rows <= table.int8_triton_max_rows:
        return CudaKernel.TRITON
    return CudaKernel.DEQUANTIZED


def cuda_int4_kernel(rows: int, table: CudaGemmRows = CUDA_GEMM_ROWS, tinygemm_fits: bool = True,
                     triton_fits: bool = True) -> CudaKernel:
    """The kernel of an int4 layer's matmul of `rows` rows on CUDA, given which kernels take
    its shape: tinygemm up to its max rows (every row count where Triton does not fit), Triton
    above and wherever tinygemm does not fit, the bf16 copy where neither does."""
    if tinygemm_fits and (rows <= table.int4_tinygemm_max_rows or not triton_fits):
        return CudaKernel.TORCH
    return CudaKernel.TRITON if triton_fits else CudaKernel.DEQUANTIZED


# At avx512_bf16, from how many rows Int8Linear runs `kernels.int8_gemm` rather than PyTorch's
# `_weight_int8pack_mm`: on the default model's layer matrices (2 cores, Zen 5) the two are even
# at 8 rows and int8_gemm is 1.3-1.6x faster at 12 to 16, level with a bf16 matmul; end to end
# (int8, decode) from 8 rows cost 18% at batch 8, from 12 gained 34% at batch 16.
INT8_GEMM_MIN_ROWS = 12
# At avx512_bf16, from how many rows Int6Linear runs `kernels.int6_gemm` rather than int6_linear:
# on Qwen2.5-1.5B's Q6_K shapes (down projection and a vocabulary slice, 2 cores) int6_linear's
# 512-bit tile pairs take 0.65x int6_gemm's time at 16 rows, 0.88x at 32 and 1.04x at 64.
INT6_GEMM_MIN_ROWS = 48


class Int8Linear(QuantizedLinear):
    """Weight-only int8 (`_weight_int8pack_mm`, bf16 activations). With many rows the matmul
    is compute-bound and that kernel runs at a fraction of a bf16 matmul's speed: above
    `max_rows` rows, `kernels.int8_gemm` (codes widened to bf16 once per panel of 32 output
    channels, vdpbf16ps over all rows; max_rows is then at most INT8_GEMM_MIN_ROWS - 1 at
    avx512_bf16) where the kernels are given, else the weight dequantized and multiplied in bf16.
    With `kernels` (see Int4Linear; in_features a multiple of 16), 1-3
    rows run `kernels.int8_linear` on the same codes. Where the level's tiles fit
    (`int8_tiles_fit`) every row count runs `kernels.int8_tiled_linear` instead, on the codes in
    tiles of output channels (`tiled_int8_layout`, the only copy kept): no transposes or
    repacking per call. At avx512_bf16 (tiles of 16) on the default model's matrices (2 cores,
    Zen 5) never slower than the bf16 layer (0.5x its time at 1 row, 0.4x at 4-8, 0.6-0.95x from
    12 to 64, 0.67x at 256); at avx2 tiles of 8 with x in int8 per block of 32 (vpmaddubsw).

    On CUDA the kernel is `cuda_int8_kernel`'s by row count and `cuda_rows` (max_rows is not
    used): `_weight_int8pack_mm`, the Triton GEMM (`triton_gemm.int8_gemm`, on the same codes)
    or the weight dequantized per call; with `int8_activations`, from the table's
    int8_int_mm_min_rows `torch._int_mm` on activations quantized per token (w8a8's numerics,
    `int8_activation_matmul`: faster prefill for w8a8's accuracy cost, so only on request)."""

    def __init__(self, record, bias, max_rows: int = 16, kernels=None, int8_activations: bool = False,
                 cuda_rows: CudaGemmRows = CUDA_GEMM_ROWS):
        super().__init__(record, bias, torch.bfloat16)
        self.codes = record["codes"]
        self.in_features = self.codes.shape[1]
        self.scales = record["scales"].to(torch.bfloat16)
        self.max_rows = max_rows
        self.kernel = None
        self.kernel_max_rows = 0
        self.tiles = None
        if int8_activations and self.codes.device.type != "cuda":
            raise ValueError(f"Int8Linear: int8_activations runs on CUDA only, the weight is on {self.codes.device}")
        # (CUDA's _int_mm takes in and out features that are multiples of 8: other layers stay weight-only)
        self.int8_activations = int8_activations and self.codes.shape[0] % 8 == 0 and self.in_features % 8 == 0
        self.cuda_rows = None  # on CUDA: the row thresholds of the layer's kernels
        if self.codes.device.type == "cuda":
            from tokenmill.layers.triton_gemm import int8_gemm  # (Triton: CUDA builds of torch bring it)

            self.cuda_rows, self.triton_gemm = cuda_rows, int8_gemm
            self.codes = self.codes.contiguous()
        if kernels is not None and self.codes.device.type == "cpu" and int8_tiles_fit(kernels, *self.codes.shape):
            self.kernel, self.tiles, self.codes = kernels, tiled_int8_layout(self.codes, tile_width(kernels)), None
        elif (kernels is not None and self.codes.device.type == "cpu" and kernels.gemv_supported()
                and self.in_features % 16 == 0):
            self.kernel = kernels
            self.codes = self.codes.contiguous()
            # (the int8-activation few-row kernel works in blocks of 32 input channels)
            if kernels.native_bf16() or self.in_features % 32 == 0:
                self.kernel_max_rows = kernel_rows(kernels)[0]
            if not kernels.native_bf16():  # no rows for PyTorch's bf16 kernel between the two
                self.max_rows = self.kernel_max_rows
            else:  # int8_gemm from INT8_GEMM_MIN_ROWS: there it beats `_weight_int8pack_mm`
                self.max_rows = min(self.max_rows, INT8_GEMM_MIN_ROWS - 1)

    def dequantized(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scales[:, None]

    def _matmul(self, x):
        if self.cuda_rows is not None:
            return self._cuda_matmul(x)
        if self.tiles is not None:
            return self.kernel.int8_tiled_linear(x.contiguous(), self.tiles, self.scales)
        rows = x.shape[0]
        if self.kernel is not None and rows <= self.kernel_max_rows:
            return self.kernel.int8_linear(x.contiguous(), self.codes, self.scales)
        if self.kernel is not None and rows > self.max_rows:
            return self.kernel.int8_gemm(x.contiguous(), self.codes, self.scales)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if rows <= self.max_rows:
            return torch.ops.aten._weight_int8pack_mm(xb, self.codes, self.scales)
        return F.linear(xb, self.dequantized())

    def _cuda_matmul(self, x):
        kernel = cuda_int8_kernel(x.shape[0], self.cuda_rows, self.int8_activations)
        if kernel is CudaKernel.TRITON:
            return self.triton_gemm(x, self.codes, self.scales)
        if kernel is CudaKernel.INT_MM:
            return int8_activation_matmul(x, self.codes.t(), self.scales, CUDA_INT_MM_MIN_ROWS)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if kernel is CudaKernel.TORCH:
            return torch.ops.aten._weight_int8pack_mm(xb, self.codes, self.scales)
        return F.linear(xb, self.dequantized())

    def cpu_decoder_spec(self):
        if self.tiles is not None:
            return ("int8_tiled", self.tiles, self.scales, self.bias, self.input_scale, 0, None, None, 0)
        return ("int8", self.codes, self.scales, self.bias, self.input_scale, self.max_rows,
                self.codes if self.kernel is not None else None, None, self.kernel_max_rows)


class Int4Linear(QuantizedLinear):
    """Weight-only int4, asymmetric groups (`_weight_int4pack_mm_for_cpu`, bf16 activations).

    With `kernels` (the compiled CPU kernels, avx2 and up) and a shape they take (in_features a
    multiple of 64; group size 32 or a multiple of 64; out_features a multiple of 16 at
    avx512_bf16, of 8 below), every matmul runs `kernels.int4_linear` instead, one kernel for
    every row count on the codes in the level's tiled layout, and PyTorch's packed copy is not
    made. The activations are quantized to int8 per block of 32 and multiplied with the codes in
    integers (csrc/cpu_gemv_avx2.cpp), over tiles of 16 output channels at avx512_bf16
    (`vpdpbusd` on 512 bits) and of 8 at avx2 to avx512_vnni (`tiled_int4_layout`): both give
    the same fp32 sums, bit for bit. A GGUF Q4_K tensor's record brings its own factors, which
    the kernels read in place of bf16 scales and mins, exact: at avx2 to avx512_vnni in 6 bits
    (`tiled_int4_super_blocks`: the file's 4.5 bits a weight against 5), at avx512_bf16 a byte
    each (`tiled_int4_factors`: 4.625 bits).

    On CUDA the kernel is `cuda_int4_kernel`'s by row count and `cuda_rows`: PyTorch's tinygemm
    (`_weight_int4pack_mm`) for few rows where the shape fits it (group size 32-256,
    in_features a multiple of 32, out_features of 8), the Triton GEMM (`triton_gemm.int4_gemm`,
    on the record's own codes and the same (scale, zero) table) above and for every shape
    tinygemm refuses. Each kernel's copy of the codes is made only where the table gives it
    rows: with both in use the codes are held twice (tinygemm's layout and the record's), one
    byte a weight in all, half a byte with one. Off the CPU and CUDA, the weight dequantized to
    bf16 once (correct, without int4's memory saving)."""

    def __init__(self, record, bias, kernels=None, cuda_rows: CudaGemmRows = CUDA_GEMM_ROWS):
        super().__init__(record, bias, torch.bfloat16)
        scales, mins = record["scales"], record["mins"]
        self.in_features = record["codes"].shape[1] * 2
        self.group_size = self.in_features // scales.shape[1]
        # PyTorch's kernels compute (code - 8) * scale + zero per group, from a [groups, N, 2] table.
        zeros = mins + 8 * scales
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.kernel = None
        self.packed = None  # PyTorch's layout of the codes (CPU; tinygemm's on CUDA)
        self.codes = None  # the record's codes, for the Triton GEMM (CUDA)
        self.dense_weight = None  # where no kernel takes the shape: the dequantized bf16 weight
        self.padding = 0  # zero output channels after the real ones in PyTorch's CPU layout
        self.cuda_rows = cuda_rows
        device = record["codes"].device.type
        inner_k_tiles = next((t for t in (8, 4, 2) if self.in_features % (16 * t) == 0), None)
        self.tinygemm_fits = (device == "cuda" and inner_k_tiles is not None and self.out_features % 8 == 0
                              and self.group_size in (32, 64, 128, 256))
        g = self.group_size
        self.triton_fits = device == "cuda" and g >= 16 and g & (g - 1) == 0
        if device != "cpu":
            # The kernel changes once at most as rows grow: the ends of the range say which run.
            ends = {cuda_int4_kernel(rows, cuda_rows, self.tinygemm_fits, self.triton_fits) for rows in (1, ANY_ROWS)}
            if CudaKernel.TORCH in ends:
                codes = unpack_int4(record["codes"])
                # tinygemm's input: two codes a byte, the even-indexed one in the high nibble
                pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
            if CudaKernel.TRITON in ends:
                from tokenmill.layers.triton_gemm import int4_gemm  # (Triton: CUDA builds of torch bring it)

                self.codes, self.triton_gemm = record["codes"].contiguous(), int4_gemm
            if CudaKernel.DEQUANTIZED in ends:
                sz = self.scales_and_zeros.float()
                self.dense_weight = dequantize_int4(unpack_int4(record["codes"]) - 8, sz[..., 0].t(),
                                                    sz[..., 1].t()).to(torch.bfloat16)
            return
        if (kernels is not None and kernels.gemv_supported() and self.in_features % 64 == 0
                and (self.group_size == 32 or self.group_size % 64 == 0)
                and self.out_features % tile_width(kernels) == 0):
            self.kernel = kernels
            width = tile_width(kernels)
            self.kernel_codes = tiled_int4_layout(record["codes"], width)
            self.kernel_pairs = None
            if "super_factors" in record and self.group_size == 32 and self.in_features % 256 == 0:
                self.kernel_pairs = (tiled_int4_super_blocks(record["factors"], record["super_factors"]) if width == 8
                                     else tiled_int4_factors(record["factors"], record["super_factors"]))
            if self.kernel_pairs is None:
                self.kernel_pairs = tiled_int4_pairs(scales, mins, width)
            # The kernels take every row count: PyTorch's copy of the codes would never be read.
            self.packed = self.scales_and_zeros = torch.empty(0, dtype=torch.uint8)
        else:
            # PyTorch's kernel takes whole tiles of 16 output channels: zero rows fill the last.
            self.padding = -self.out_features % 16
            codes = F.pad(record["codes"], (0, 0, 0, self.padding))
            self.scales_and_zeros = F.pad(self.scales_and_zeros, (0, 0, 0, self.padding))
            self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(part), 2)
                                     for part in codes.split(PACK_ROWS)])

    def _matmul(self, x):
        if self.kernel is not None:
            return self.kernel.int4_linear(x.contiguous(), self.kernel_codes, self.kernel_pairs, self.group_size)
        if x.device.type != "cpu":
            return self._cuda_matmul(x)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features] if self.padding else y

    def _cuda_matmul(self, x):
        kernel = cuda_int4_kernel(x.shape[0], self.cuda_rows, self.tinygemm_fits, self.triton_fits)
        if kernel is CudaKernel.TRITON:
            return self.triton_gemm(x, self.codes, self.scales_and_zeros, self.group_size)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if kernel is CudaKernel.DEQUANTIZED:
            return F.linear(xb, self.dense_weight)
        return torch.ops.aten._weight_int4pack_mm(xb.contiguous(), self.packed, self.group_size, self.scales_and_zeros)

    def cpu_decoder_spec(self):
        if self.padding:
            return None
        kernel = (self.kernel_codes, self.kernel_pairs, ANY_ROWS) if self.kernel is not None else (None, None, 0)
        return ("int4", self.packed, self.scales_and_zeros, self.bias, self.input_scale, self.group_size, *kernel)


class Int6Linear(QuantizedLinear):
    """Weight-only 6-bit, symmetric groups of 16 input channels: w = scale * (code - 32), code
    0..63 (formats.quantize_int6), 7 bits a weight with the bf16 scales. A GGUF file's Q6_K and
    Q5_0 tensors run as it under `--quantization auto` where the compiled kernels take it
    (`models/gguf_blocks.py`): their own codes and scales (Q6_K's sub-blocks are groups of 16), in
    place of int8's 8 bits a weight requantized per channel.

    With the kernels (AVX2 and up) and out_features a multiple of 8, in_features of 32:
    `kernels.int6_linear` at every row count, over tiles of 8 output channels
    (`tiled_int6_layout`; x in int8 per block of 32, as the int4 kernel at avx2); a Q6_K
    record's own factors in place of the bf16 scales where in_features are a multiple of 256
    (`tiled_int6_super_blocks`: 6.5625 bits a weight). At avx512_bf16 int6_linear takes pairs
    of tiles on 512-bit registers from 2 rows (`vpdpbusd`, the same sums), and above `max_rows`
    (INT6_GEMM_MIN_ROWS - 1) rows `kernels.int6_gemm` runs on the same tiles instead: each weight
    widened once per call to bf16, bf16 products. Otherwise the dequantized weight in fp32 and
    F.linear (correct, without the memory saving)."""

    def __init__(self, record, bias, kernels=None):
        super().__init__(record, bias, torch.float32)
        codes, scales = record["codes"], record["scales"]
        self.in_features = codes.shape[1]
        self.kernel = self.weight = None
        self.max_rows = 0  # above it int6_gemm (0: int6_linear at every row count)
        if (kernels is not None and codes.device.type == "cpu" and kernels.gemv_supported()
                and self.out_features % 8 == 0 and self.in_features % 32 == 0):
            self.kernel = kernels
            if kernels.native_bf16():
                self.max_rows = INT6_GEMM_MIN_ROWS - 1
            self.low, self.high = tiled_int6_layout(codes)
            if "super_factors" in record and self.in_features % 256 == 0:
                self.tile_scales = tiled_int6_super_blocks(record["factors"], record["super_factors"])
            else:  # [N/8, K/16, 8] bf16, a tile's 8 scales per group
                self.tile_scales = scales.reshape(self.out_features // 8, 8, -1).transpose(1, 2).to(torch.bfloat16).contiguous()
        else:
            self.weight = dequantize_int6(codes, scales)

    def _matmul(self, x):
        if self.kernel is not None and 0 < self.max_rows < x.shape[0]:
            return self.kernel.int6_gemm(x.contiguous(), self.low, self.high, self.tile_scales)
        if self.kernel is not None:
            return self.kernel.int6_linear(x.contiguous(), self.low, self.high, self.tile_scales)
        return F.linear(x.float(), self.weight)

    def cpu_decoder_spec(self):
        if self.kernel is None:
            return None
        return ("int6", self.low, self.tile_scales, self.bias, self.input_scale, self.max_rows, self.high, None, ANY_ROWS)


class StackedLinear(nn.Module):
    """Output channels in consecutive row ranges, each range a layer of its own format: y =
    cat(part(x) for part in parts). A GGUF fused linear whose tensors are stored as different
    types runs each part as stored (a Q4_K_M file's qkv with q, k Q4_K and v Q6_K: an int4 and an
    int6 layer) instead of all of it requantized to int8."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def cpu_decoder_spec(self) -> tuple | None:
        """("stacked", the parts' specs, ...): the DecoderStack runs each part and concatenates."""
        specs = [part.cpu_decoder_spec() for part in self.parts]
        if any(spec is None for spec in specs):
            return None
        return ("stacked", tuple(specs), None, None, None, 0, None, None, 0)


class W8A8Linear(QuantizedLinear):
    """int8 weights (per output channel) times int8 activations (per token, quantized on the
    fly), accumulated in int32 by `torch._int_mm`, rescaled to fp32. On a CPU below avx512_vnni
    (no VNNI) oneDNN's int8 matmul saturates, so the codes are kept as fp32 and multiplied in
    fp32 instead: the same integer products, no memory saving (weight-only int8 is the fast
    format there)."""

    def __init__(self, record, bias):
        super().__init__(record, bias, torch.float32)
        self.codes_t = record["codes"].t().contiguous()  # [K, N]: _int_mm's layout
        self.in_features = self.codes_t.shape[0]
        self.scales = record["scales"].float()
        self.min_rows = CUDA_INT_MM_MIN_ROWS if self.codes_t.device.type == "cuda" else 1
        self.float_codes_t = None
        if self.codes_t.device.type == "cpu" and not onednn_int8_exact(host_isa()):
            self.float_codes_t = self.codes_t.float()

    def _matmul(self, x):
        if self.float_codes_t is not None:
            codes, row_scales = quantize_rows_int8(x)
            return (codes.float() @ self.float_codes_t) * row_scales * self.scales
        return int8_activation_matmul(x, self.codes_t, self.scales, self.min_rows)


# CUDA's _int_mm wants more than 16 rows: fewer are padded up to this many.
CUDA_INT_MM_MIN_ROWS = 17


def int8_activation_matmul(x: torch.Tensor, codes_t: torch.Tensor, scales: torch.Tensor, min_rows: int) -> torch.Tensor:
    """x [M, K] quantized per row to int8 (formats.quantize_rows_int8) times int8 codes_t [K, N]
    (row- or column-major: a transposed [N, K] weight serves as it is) by `torch._int_mm` in
    int32, rescaled by the row scales and the weight's `scales` [N]: fp32 [M, N]. Fewer than
    `min_rows` rows are padded with zero rows for the matmul."""
    codes, row_scales = quantize_rows_int8(x)
    rows = codes.shape[0]
    if rows < min_rows:
        codes = F.pad(codes, (0, 0, 0, min_rows - rows))
    acc = torch._int_mm(codes, codes_t)[:rows]
    return acc.float() * row_scales * scales


class Fp8Linear(QuantizedLinear):
    """E4M3 weights with per-output-channel scales. On a CUDA GPU with FP8 tensor cores (compute
    capability 8.9+) activations are quantized per token to E4M3 and multiplied by
    `torch._scaled_mm`; elsewhere FP8 is a storage format: the weight is widened to the
    activation dtype for each matmul (half of bf16's memory, not faster)."""

    def __init__(self, record, bias):
        super().__init__(record, bias, torch.float32)
        self.codes = record["codes"]
        self.in_features = self.codes.shape[1]
        self.scales = record["scales"].float()
        self.scaled_mm = fp8_gemm_supported(self.codes.device)

    def _matmul(self, x):
        if self.scaled_mm:
            row_scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / FP8_MAX
            xq = (x.float() / row_scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.codes.t(), scale_a=row_scales, scale_b=self.scales[None, :],
                                    out_dtype=torch.bfloat16)
        return F.linear(x, self.codes.to(x.dtype) * self.scales[:, None].to(x.dtype))


def fp8_gemm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


LINEAR_CLASSES: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear, "fp8": Fp8Linear}
assert tuple(LINEAR_CLASSES) == QUANTIZATION_METHODS


def build_linear(method: str, record: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 cpu_kernels=None) -> QuantizedLinear:
    """The layer for a record of `method` (tensors already on the layer's device); `cpu_kernels`
    (layers.cpu_kernels.load()) for the int4 and int8 layers' compiled kernels (few rows and many)."""
    if method == "int4":
        return Int4Linear(record, bias, cpu_kernels)
    if method == "int8":
        return Int8Linear(record, bias, kernels=cpu_kernels)
    if method == "int6":  # (no user-facing method: a GGUF file's 5- and 6-bit tensors as stored)
        return Int6Linear(record, bias, cpu_kernels)
    return LINEAR_CLASSES[method](record, bias)


def convert_linears(model: nn.Module, cpu_kernels=None) -> None:
    """Replace every `nn.Linear` of `model` (already on its device, in its dtype) by a
    `DenseLinear` in place (`cpu_kernels`: see DenseLinear). (Quantized layers:
    `tokenmill.quantization.quantize.quantize_model`.)"""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, DenseLinear(child.weight.detach(), bias, cpu_kernels))
