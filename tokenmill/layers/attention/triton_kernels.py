"""Triton kernels for attention over the paged KV cache (the `triton` attention backend).

Three kernels, each with a launcher taking torch tensors:
- `write_kv`: store a step's keys and values at their slots (quantizing for an int8 / fp8
  cache: one scale per token and KV head, as `kv_quant.quantize_kv`). A negative slot is
  skipped (padding rows of a captured batch).
- `paged_decode`: one query per sequence, split-K over the sequence ("flash decoding"): each
  program attends one (sequence, KV head, split) and keeps a partial output with its running max
  and sum; a second kernel combines the splits. The query heads of a KV head are the rows of one
  tile (GQA/MQA: the KV head is read once for its whole group, never copied).
- `paged_prefill`: causal attention of variable-length query chunks, flash-attention style
  (tiles of queries against tiles of keys, online softmax, nothing of size q_len x seq_len),
  reading every key - the chunk's own and earlier context (chunked prefill, prefix-cache hits,
  draft verification) - from the paged cache, where `write_kv` has just put them. A program's
  rows are a few query positions times the query heads of one KV head, so each key tile is read
  once for the whole group, as in decode.

Both attention kernels take a sliding window (each query sees its `window` latest keys, itself
included; key tiles wholly before a window are never read) and soft-capped scores (cap *
tanh(score / cap), before the mask), with `TorchAttentionBackend.forward`'s semantics.

Keys are gathered per token (`block_table[pos // block_size]`), so any block size works, and a
tile of keys may span several cache blocks. Cache layout: `layers.attention.backend`.

Under Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) bfloat16
arithmetic is not supported (its values are held as raw bits): the launchers then upcast the
dot operands to float32 (`UPCAST`); compiled on a GPU, bf16 and fp16 operands go to the tensor
cores as they are, with float32 accumulation. float32 operands are multiplied in full float32
unless the user allowed TF32 (`dot_precision`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter instead of compiling them."""
    return bool(triton.knobs.runtime.interpret)


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the dot operands of queries of `dtype` are upcast to float32: bf16 in the interpreter."""
    return dtype == torch.bfloat16 and interpreting()


def _tf32_allowed() -> bool:
    """Whether the user let float32 matmuls use TF32 in PyTorch."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        # torch >= 2.9: "tf32" after the new API or the legacy one (set_float32_matmul_precision
        # "high" / "medium", allow_tf32), whose getters raise once the new API has been used.
        return matmul.fp32_precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest" or matmul.allow_tf32


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` of the attention kernels' `tl.dot`s for queries of `dtype`.

    "tf32" (float32 operands rounded to TF32 on the tensor cores) only when the kernels are
    compiled for a GPU, the queries are float32 and the user allowed TF32 in PyTorch
    (`torch.set_float32_matmul_precision("high")`, `torch.backends.cuda.matmul.allow_tf32 =
    True` or `.fp32_precision = "tf32"`); otherwise "ieee", full float32 products, which fp32
    greedy parity with transformers needs. Always "ieee" in the interpreter. bf16 / fp16 operands
    go to the tensor cores as they are, whatever this says."""
    if dtype == torch.float32 and not interpreting() and _tf32_allowed():
        return "tf32"
    return "ieee"


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
MAX_DECODE_SPLITS = 16  # the most splits of one decode's keys (the combine kernel's padded width)


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to nearest-even on the float8 e4m3 grid, as torch's cast
    does: 3 mantissa bits for normal values (an integer add on the bits carries into the
    exponent), steps of 2**-9 below 2**-6. Triton's interpreter casts with a wrong carry."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # drop 20 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, slot_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
    QUANT: tl.constexpr, ROUND: tl.constexpr, QMAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = slot * NUM_KV_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    if QUANT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        # Divisions rounded to nearest (div_rn), as torch's are: compiled for a GPU, `/` on
        # float32 is an approximate division (up to 2 ulp), which would give other scales and
        # codes than kv_quant.quantize_kv.
        k_scale = tl.div_rn(tl.max(tl.abs(k), axis=1), QMAX)  # [HEADS_PAD]
        v_scale = tl.div_rn(tl.max(tl.abs(v), axis=1), QMAX)
        # An all-zero vector has scale 0: divide by the smallest normal instead (codes 0).
        k = tl.div_rn(k, tl.maximum(k_scale, 1.1754943508222875e-38)[:, None])
        v = tl.div_rn(v, tl.maximum(v_scale, 1.1754943508222875e-38)[:, None])
        if ROUND:  # int8: to nearest, ties to even (as torch.round); exact for |x| < 2**22
            k = (k + 12582912.0) - 12582912.0
            v = (v + 12582912.0) - 12582912.0
        else:  # fp8: rounded to the e4m3 grid here, so the cast below is exact
            k = _round_to_e4m3(k)
            v = _round_to_e4m3(v)
        hmask = heads < NUM_KV_HEADS
        tl.store(key_scale_ptr + slot * NUM_KV_HEADS + heads, k_scale, mask=hmask)
        tl.store(value_scale_ptr + slot * NUM_KV_HEADS + heads, v_scale, mask=hmask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv_tile(cache_ptr, scale_ptr, tok, kvh, dims, nmask, dmask,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Keys or values of the cache tokens `tok` [N] (global token index = block * block_size +
    offset) for KV head `kvh`: [N, D_PAD], masked rows and dims 0; float32 when QUANT."""
    x = tl.load(cache_ptr + (tok * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + dims[None, :],
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    if QUANT:
        scale = tl.load(scale_ptr + tok * NUM_KV_HEADS + kvh, mask=nmask, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    return x


@triton.jit
def _tanh(x):
    """float32 tanh from exp2 (Triton's interpreter has no tanh, libdevice is compiled-only):
    (1 - t) / (1 + t) with t = e**(-2|x|), which tends to 0, never overflowing, as |x| grows;
    below |x| = 1/8, where 1 - t would cancel, the odd Taylor series (to x**7: error < 2e-9 x)."""
    a = tl.abs(x)
    t = tl.exp2(a * -2.8853900817779268)  # -2 log2(e)
    big = (1.0 - t) / (1.0 + t)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    y = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_tile(q, m, l, acc, pos, nmask, visible, table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                 kvh, dims, dmask, qk_scale, softcap, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the keys at sequence positions `pos` (those with `nmask`, read through the block
    table at `table_ptr`) into the online softmax (m, l, acc) of the query rows `q`; `visible`
    [rows, keys] masks scores. Scores are in log2 units: q.k * qk_scale, where qk_scale is
    scale * log2(e); with SOFTCAP, qk_scale is scale / cap and `softcap` is cap * log2(e), so
    that the score is cap * tanh(q.k * scale / cap) * log2(e)."""
    blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=nmask, other=0)
    tok = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    k = _load_kv_tile(k_cache_ptr, k_scale_ptr, tok, kvh, dims, nmask, dmask, NUM_KV_HEADS, HEAD_DIM, QUANT)
    v = _load_kv_tile(v_cache_ptr, v_scale_ptr, tok, kvh, dims, nmask, dmask, NUM_KV_HEADS, HEAD_DIM, QUANT)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s = _tanh(s) * softcap
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row that has seen no key yet (a padding row, or one whose window starts past this
    # tile) keeps m = -inf: subtracting 0 instead leaves its alpha and p 0 rather than NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l, acc


# The split count is a runtime argument, not specialized on: a step's count follows its batch
# and longest sequence, and a constexpr would compile a variant of each kernel per count while
# serving (a pause of a second or more at each new one). The window likewise, so that layers of
# different windows share one compiled kernel (whether there is one is a constexpr).
@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr, acc_ptr, ml_ptr,
    stride_qt, stride_qh, stride_table, qk_scale, softcap, window, num_splits,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr,
    TILE_N: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Program (seq, kv_head, split): the GROUP query heads of kv_head against the split's
    share of the keys the query sees (the last `window` with SLIDING, else all); writes the
    unnormalized output and the running (max, sum)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # the oldest key the query sees
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE_N) * TILE_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    rmask = rows < GROUP
    dmask = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, TILE_N):
        pos = n0 + tl.arange(0, TILE_N)
        nmask = pos < end
        m, l, acc = _attend_tile(q, m, l, acc, pos, nmask, nmask[None, :], tables_ptr + seq * stride_table,
                                 k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kvh, dims, dmask, qk_scale,
                                 softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANT, PRECISION, SOFTCAP)
    # Partials: acc [seq, head, split, HEAD_DIM], (m, l) [seq, head, split, 2]
    part = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=rmask[:, None] & dmask[None, :])
    tl.store(ml_ptr + part * 2, m, mask=rmask)
    tl.store(ml_ptr + part * 2 + 1, l, mask=rmask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program (seq, head): the splits' partial outputs rescaled to their common max and summed.
    A sequence of length 0 (a padding row) gets zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    smask = splits < num_splits
    dmask = dims < HEAD_DIM
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(ml_ptr + part * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: a padding row
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh nothing
    total = tl.sum(l * w, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, query_start_ptr, seq_lens_ptr,
    out_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_table, qk_scale, softcap, window,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (query tile, sequence, kv_head): BLOCK_M queries of one chunk times the GROUP
    query heads of kv_head, as the rows of one tile (row r: query r // GROUP, head r % GROUP;
    the ROWS - BLOCK_M * GROUP last rows idle), against the keys they may see - positions 0 ..
    their own, or with SLIDING only the `window` latest of those - read from the paged cache
    once for the whole group."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_context = seq_len - q_len

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D_PAD)
    query = tile * BLOCK_M + rows // GROUP  # within the chunk
    heads = kvh * GROUP + rows % GROUP
    rmask = (rows < BLOCK_M * GROUP) & (query < q_len)
    dmask = dims < HEAD_DIM
    q_pos = num_context + query
    tokens = q_start + query
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, num_context + (tile + 1) * BLOCK_M)  # the tile's last query sees up to here
    kv_start = 0
    if SLIDING:  # the oldest key the tile's first query sees; later queries see from later on
        kv_start = tl.maximum(num_context + tile * BLOCK_M - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < kv_end
        visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m, l, acc = _attend_tile(q, m, l, acc, pos, nmask, visible, tables_ptr + seq * stride_table,
                                 k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kvh, dims, dmask, qk_scale,
                                 softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANT, PRECISION, SOFTCAP)
    o = acc / tl.maximum(l, 1e-30)[:, None]  # l = 0 only in rows not stored: idle, or past the chunk
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


_LOG2E = 1.4426950408889634


def _cache_args(kv_cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(key cache, value cache, key scales, value scales, quantized); the scale arguments of an
    unquantized cache are placeholders the kernels never read."""
    if len(kv_cache) == 4:
        return (*kv_cache, True)
    return kv_cache[0], kv_cache[1], kv_cache[0], kv_cache[1], False


def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: tuple[torch.Tensor, ...]) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at the cache slots `slot_mapping`
    (int64, -1 = skip); an int8 / fp8 cache gets codes and per token-head scales."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key_cache, value_cache, key_scales, value_scales, quant = _cache_args(kv_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, slot_mapping, key_cache, value_cache, key_scales, value_scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=_pow2(num_kv_heads, 1), D_PAD=_pow2(head_dim, 1),
        QUANT=quant, ROUND=key_cache.dtype == torch.int8, QMAX=_QMAX.get(key_cache.dtype, 1.0),
    )


def _score_args(scale: float, window: int | None, softcap: float | None) -> dict:
    """The attention kernels' score arguments (`_attend_tile`): qk_scale and softcap, and the
    window (0 and unread without one)."""
    return dict(qk_scale=scale / softcap if softcap is not None else scale * _LOG2E,
                softcap=softcap * _LOG2E if softcap is not None else 0.0, window=window or 0,
                SLIDING=window is not None, SOFTCAP=softcap is not None)


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: tuple[torch.Tensor, ...],
    block_tables: torch.Tensor,  # [num_seqs, width] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, the new token included; 0 = a padding row
    scale: float,
    num_splits: int,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
    tile_n: int = 64,
    window: int | None = None,  # the query sees its `window` latest keys, itself included
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
) -> None:
    """Each sequence's keys (the last `window` of them with a window: nothing before is read)
    are cut into `num_splits` ranges of whole key tiles, some possibly empty."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return
    key_cache, value_cache, key_scales, value_scales, quant = _cache_args(kv_cache)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, acc, ml,
        query.stride(0), query.stride(1), block_tables.stride(0), num_splits=num_splits,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        GROUP_PAD=_pow2(group), D_PAD=_pow2(head_dim), TILE_N=tile_n,
        QUANT=quant, UPCAST=_upcast(query.dtype), PRECISION=dot_precision(query.dtype),
        **_score_args(scale, window, softcap),
    )
    _decode_combine_kernel[(num_seqs, num_heads)](
        acc, ml, out, out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=_pow2(max(num_splits, MAX_DECODE_SPLITS), 1),
        D_PAD=_pow2(head_dim, 1),
    )


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the chunks, back to back
    kv_cache: tuple[torch.Tensor, ...],
    block_tables: torch.Tensor,  # [num_seqs, width] int32
    query_start: torch.Tensor,  # [num_seqs + 1] int32: chunk i is query[query_start[i]:query_start[i + 1]]
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # like query, written
    window: int | None = None,  # each query sees its `window` latest keys, itself included
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    tile_rows: int = 64,
    block_n: int = 64,
) -> None:
    """A program's tile has `tile_rows` rows (a power of two, at least 16 for `tl.dot`; more
    when a KV head's group is larger): tile_rows // group query positions times the group's
    heads. Its keys, in tiles of `block_n`, start at the oldest one its first query sees."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = query.shape
    key_cache, value_cache, key_scales, value_scales, quant = _cache_args(kv_cache)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    assert tile_rows >= 16 and tile_rows == triton.next_power_of_2(tile_rows), tile_rows
    rows = max(tile_rows, triton.next_power_of_2(group))
    block_m = rows // group  # query positions per tile
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_kv_heads)](
        query, key_cache, value_cache, key_scales, value_scales, block_tables, query_start, seq_lens, out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, ROWS=rows, BLOCK_N=block_n, D_PAD=_pow2(head_dim), QUANT=quant,
        UPCAST=_upcast(query.dtype), PRECISION=dot_precision(query.dtype), **_score_args(scale, window, softcap),
    )
