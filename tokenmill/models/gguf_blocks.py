"""GGUF's quantized weights in tokenmill's weight formats (`layers/quantization/formats.py`), without a
detour through float32 where the block type allows it.

Q4_0, Q4_1 and Q4_K hold 4-bit codes q in 0..15 and, per group of 32 weights, w = q * s + m: an
int4 record at group size 32, exactly.

| GGUF type | s | m |
|---|---|---|
| Q4_0 | d | -8 d |
| Q4_1 | d | m |
| Q4_K | d * sc_j | -dmin * m_j (sub-block j's 6-bit factors) |

Those are repacked: the codes move, s and m are computed in float32 from the file's fp16 and 6-bit
factors, and nothing is rounded. A Q4_K record also keeps the factors themselves ("factors": sc_j
and m_j, uint8 [N, K/32, 2]; "super_factors": d and -dmin, float16 [N, K/256, 2]), which the AVX2
int4 kernel reads in place of s and m, the factors in 6 bits as in the file: 4.5 bits a weight against 5
(`Int4Linear`). The other block types map by precision (`stored_method`): more
than 4 bits (Q5_*, Q6_K, Q8_0, IQ4_*) onto int8 per output channel, requantized from their
dequantized values; fewer (Q2_K, Q3_K, the IQ1-3 and ternary types) onto int4 by round-to-nearest;
float types stay dense. Where the compiled CPU kernels run int6 (AVX2 and up), Q6_K is repacked
into an int6 record instead, exactly: its codes q in 0..63 and, per sub-block of 16, w = (q - 32)
* d * sc_j (the int8 factor sc_j, negative ones too), 7 bits a weight against int8's 8; with the
factors themselves ("factors": sc_j, int8 [N, K/16]; "super_factors": d, float16 [N, K/256]),
which the int6 kernel reads in place of the scales: 6.5625 bits a weight (`Int6Linear`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

INT4_REPACKED = frozenset({"Q4_0", "Q4_1", "Q4_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
BELOW_4_BITS = frozenset({"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                          "TQ1_0", "TQ2_0", "Q1_0"})
GROUP_SIZE = 32  # of every repacked record
# Repacked into int6 (7 bits a weight with its scales) where the kernels run it, int8 elsewhere.
INT6_TYPES = frozenset({"Q6_K"})

# Rows repacked at a time (numpy's temporaries are a few times the chunk).
_CHUNK_BYTES = 16 << 20
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}


def stored_method(type_name: str, int6: bool = False) -> str | None:
    """The tokenmill method a tensor stored as GGUF type `type_name` runs as: None (dense) for a
    float type, "int4" for 4 bits or fewer, "int6" for Q6_K where the kernels run int6 (`int6`),
    else "int8"."""
    if type_name in FLOAT_TYPES:
        return None
    if type_name in INT4_REPACKED or type_name in BELOW_4_BITS:
        return "int4"
    return "int6" if int6 and type_name in INT6_TYPES else "int8"


# From most precise to least: a linear of several tensors takes the first of its tensors' methods.
_PRECEDENCE = ("int8", "int6", "int4")


def linear_method(type_names: Iterable[str], int6: bool = False) -> str | None:
    """The method of a linear layer whose checkpoint tensors (q, k and v of a fused qkv_proj, say)
    are stored as `type_names`: the most precise of theirs (dense > int8 > int6 > int4), int8 for
    int6 with another method (an int6 record is the file's codes, of every tensor)."""
    methods = {stored_method(t, int6) for t in type_names}
    if None in methods or not methods:
        return None
    if "int6" in methods and len(methods) > 1:
        return "int8"
    return next(m for m in _PRECEDENCE if m in methods)


def stacked_methods(type_names: list[str], int6: bool = False) -> list[str] | None:
    """Each tensor's own method where a fused linear's tensors are exact int4 and int6 records
    side by side (a Q4_K_M file's qkv: q, k Q4_K and v Q6_K), which run as one layer per row
    range (layers/linear.py StackedLinear) rather than all requantized to int8
    (`linear_method`); None for any other mix."""
    methods = [stored_method(t, int6) for t in type_names]
    exact = all(t in INT4_REPACKED or t in INT6_TYPES for t in type_names)
    return methods if int6 and exact and set(methods) == {"int4", "int6"} else None


def int4_record(type_name: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """The int4 record (codes uint8 [N, K/2], scales and mins float32 [N, K/32]; for Q4_K also its
    factors, see above) of a Q4_0 / Q4_1 / Q4_K tensor given as its raw blocks, uint8 [N, bytes
    per row]."""
    if type_name not in INT4_REPACKED:
        raise ValueError(f"GGUF type {type_name} is not repacked into int4")
    rows, row_bytes = blocks.shape
    k = row_bytes // _BLOCK_BYTES[type_name] * (256 if type_name == "Q4_K" else 32)
    codes = np.empty((rows, k // 2), dtype=np.uint8)
    scales = np.empty((rows, k // GROUP_SIZE), dtype=np.float32)
    mins = np.empty_like(scales)
    extra: dict[str, np.ndarray] = {}
    if type_name == "Q4_K":
        extra = {"factors": np.empty((rows, k // GROUP_SIZE, 2), dtype=np.uint8),
                 "super_factors": np.empty((rows, k // 256, 2), dtype=np.float16)}
    step = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        part = np.ascontiguousarray(blocks[start : start + step])
        q, s, m, *more = _UNPACK[type_name](part)
        q = q.reshape(part.shape[0], k)
        codes[start : start + step] = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))  # formats.pack_int4's layout
        scales[start : start + step] = s.reshape(part.shape[0], -1)
        mins[start : start + step] = m.reshape(part.shape[0], -1)
        for key, value in zip(extra, more):
            extra[key][start : start + step] = value
    record = {"codes": codes, "scales": scales, "mins": mins, **extra}
    return {key: torch.from_numpy(value) for key, value in record.items()}


def int6_record(type_name: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """The int6 record (codes uint8 [N, K] in 0..63, scales float32 [N, K/16], and the factors
    above) of a Q6_K tensor
    given as its raw blocks, uint8 [N, bytes per row] (gguf-py's Q6_K layout: 128 bytes of low
    nibbles, 64 of top 2-bit pairs, 16 int8 factors, fp16 d per 256 weights)."""
    if type_name not in INT6_TYPES:
        raise ValueError(f"GGUF type {type_name} is not repacked into int6")
    rows, row_bytes = blocks.shape
    k = row_bytes // _BLOCK_BYTES[type_name] * 256
    codes = np.empty((rows, k), dtype=np.uint8)
    scales = np.empty((rows, k // 16), dtype=np.float32)
    factors = np.empty((rows, k // 16), dtype=np.int8)
    super_factors = np.empty((rows, k // 256), dtype=np.float16)
    step = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        b = np.ascontiguousarray(blocks[start : start + step]).reshape(-1, _BLOCK_BYTES[type_name])
        n = b.shape[0]
        d16 = np.ascontiguousarray(b[:, 208:210]).view(np.float16)
        sc8 = b[:, 192:208].view(np.int8)
        d, sc = d16.astype(np.float32), sc8.astype(np.float32)
        ql = b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(n, -1, 32)
        qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
        part = b.shape[0] * 256 // k
        codes[start : start + part] = (ql | (qh << np.uint8(4))).reshape(part, k)
        scales[start : start + part] = (d * sc).reshape(part, -1)
        factors[start : start + part] = sc8.reshape(part, -1)
        super_factors[start : start + part] = d16.reshape(part, -1)
    return {"codes": torch.from_numpy(codes), "scales": torch.from_numpy(scales), "factors": torch.from_numpy(factors),
            "super_factors": torch.from_numpy(super_factors)}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-weight group -> [..., 32] codes: low nibbles first, then high."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q4_0(blocks: np.ndarray):
    b = blocks.reshape(blocks.shape[0], -1, 18)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return _nibbles(b[..., 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray):
    b = blocks.reshape(blocks.shape[0], -1, 20)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return _nibbles(b[..., 4:]), d, m


def _q4_k(blocks: np.ndarray):
    from gguf.quants import Q4_K

    rows = blocks.shape[0]
    b = blocks.reshape(-1, 144)  # one super-block of 256 weights, 8 sub-blocks of 32, a row
    d16 = np.ascontiguousarray(b[:, :2]).view(np.float16)
    dmin16 = np.ascontiguousarray(b[:, 2:4]).view(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    # 4 chunks of 32 bytes: chunk j's low nibbles are sub-block 2j, its high nibbles 2j + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(rows, -1)
    factors = np.stack([sc.reshape(rows, -1), m.reshape(rows, -1)], axis=-1).astype(np.uint8)
    super_factors = np.stack([d16.reshape(rows, -1), -dmin16.reshape(rows, -1)], axis=-1)
    return (q, (d * sc.astype(np.float32)).reshape(rows, -1), -(dmin * m.astype(np.float32)).reshape(rows, -1),
            factors, super_factors)


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}
