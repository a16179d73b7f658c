"""The attention backend interface and its portable PyTorch implementation.

A step's attention work is described once, on the host, as a `BatchLayout` (each token's cache
slot, each sequence's block table and lengths); the model's backend turns that into its own
metadata (`build_metadata`), which every layer's `forward` then reads. `TorchAttentionBackend`
(here) groups decodes into padded batched SDPAs; the Triton backend (`triton_backend`) keeps
flat tensors its kernels index.

The flat batch of a step is ordered decode tokens first (one query per request), then prefill
chunks. The backend writes the step's keys/values into the paged cache at `slot_mapping`, then
attends each query to its own sequence only: decodes as a few padded batched SDPAs over their
gathered blocks (decodes arrive sorted by context length and split into groups of similar
length, so little work is spent on padding), prefill chunks one sequence at a time (a chunk
may start after earlier context already in the cache: chunked prefill). With the compiled CPU
kernels both are single calls that read the cache in place (`TorchAttentionBackend`), and a short
chunk over cached context (a request verifying drafts) is attended as one decode per token
(`chunks_as_decodes`).

KV cache layout per layer: a `(key_cache, value_cache)` pair, each
`[num_blocks, block_size, num_kv_heads, head_dim]` in the compute dtype; or, quantized
(`kv_cache_dtype` int8 / fp8, see `kv_quant`), `(key_codes, value_codes, key_scales,
value_scales)`: codes of that shape, one float32 scale per token and KV head
`[num_blocks, block_size, num_kv_heads]`. Writes quantize; reads of cached context dequantize
to the compute dtype; a prefill chunk with no earlier context attends to its own
full-precision K/V. Every tensor is indexed by block along dim 0; slot s is block
s // block_size, offset s % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.kv_quant import dequantize_kv, indexable, quantize_kv


# The longest chunk over cached context that the CPU kernels attend as decodes (chunks_as_decodes).
DECODE_KERNEL_MAX_QUERY = 24


@dataclass
class BatchLayout:
    """A step's tokens as attention sees them: decodes first (one query each, sorted by
    context length, shortest first), then prefill chunks, in the order of the flat batch."""

    block_size: int
    slots: list[int]  # per token: the cache slot its K/V is written to
    decode_tables: list[list[int]]  # per decode: the blocks holding its context (new token included)
    decode_seq_lens: list[int]  # per decode: its context length, the new token included
    prefill_query_lens: list[int]  # per chunk: its length
    prefill_seq_lens: list[int]  # per chunk: the context length, the chunk included
    prefill_tables: list[list[int]]  # per chunk: the blocks holding that context


@dataclass
class DecodeGroup:
    """Consecutive decodes attended as one padded batch."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64 (padded with block 0)
    # Keys attended: the first kv_len of the gathered blocks, and of those the True ones of the
    # mask [num_seqs, 1, 1, kv_len]; a group of one sequence has kv_len = its length, mask None.
    kv_len: int
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    num_decodes: int  # the first num_decodes tokens are single-query decodes, one per request
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's K/V
    decode_groups: list[DecodeGroup]  # cover the num_decodes decodes, in order
    # Prefill part: per sequence, its chunk length, its context length incl. the chunk, and
    # the ids of the blocks holding that context.
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]
    prefill_block_ids: list[torch.Tensor]
    # With a decode kernel (decode_groups then empty): every decode's blocks, padded with block 0
    # to the longest, [num_decodes, max_num_blocks] int32, and context lengths [num_decodes] int32.
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    # With the prefill kernel: the chunks' blocks padded likewise [num_chunks, max_num_blocks],
    # their context lengths and chunk lengths [num_chunks], all int32; and the query dtypes it takes.
    prefill_kernel_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prefill_kernel_dtypes: frozenset[torch.dtype] = frozenset()
    # The step as the host laid it out, and its longest context: a layer with a sliding window
    # at least that long, and no logit soft-capping, attends as every other layer does.
    layout: BatchLayout | None = None
    max_seq_len: int = 0
    # The masked decode path's gathered tables and masks, per window (None: whole contexts).
    windowed_decodes: dict = field(default_factory=dict)


class AttentionBackend(Protocol):
    def build_metadata(self, layout: BatchLayout, device: torch.device):  # -> this backend's metadata
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...],  # 2 tensors, or 4 when quantized (module docstring)
        meta,  # what build_metadata returned for this step
        scale: float,
        kv_written: bool = False,  # key and value are already stored at meta.slot_mapping
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], not necessarily contiguous
        ...


class TorchAttentionBackend:
    """Reference backend: plain PyTorch ops, any device, MHA/MQA/GQA.

    With `kernels` (the compiled CPU kernels, `layers.cpu_kernels`; a cache of the compute
    dtype or int8 codes + scales, on the CPU), decodes are attended by its
    `paged_decode_attention`, which reads the cache in place through the block tables, instead
    of gathered padded groups and SDPA; and, for query dtypes in `prefill_attention_dtypes()`
    (float32 from AVX2 up, bf16 at AVX-512 BF16) with a cache of that dtype or int8 and a head
    size of 64 or 128, every prefill chunk of the step by one `paged_prefill_attention` call
    (flash-style, over the cache the chunk was just written to; a chunk with no earlier context
    over its own K/V, as below) instead of SDPA per chunk."""

    def __init__(self, group_cost: int = 12, kernels=None):
        self.group_cost = group_cost  # see split_by_length
        self.kernels = kernels
        self.prefill_dtypes = frozenset(kernels.prefill_attention_dtypes()) if kernels is not None else frozenset()

    def build_metadata(self, layout: BatchLayout, device) -> AttentionMetadata:
        tables = seq_lens = prefill_args = None
        if self.kernels is not None:
            layout = chunks_as_decodes(layout)
        if self.kernels is not None and layout.decode_tables:
            tables = _padded_tables(layout.decode_tables)
            seq_lens = torch.tensor(layout.decode_seq_lens, dtype=torch.int32)
        if self.prefill_dtypes and layout.prefill_tables:
            prefill_args = (_padded_tables(layout.prefill_tables), torch.tensor(layout.prefill_seq_lens, dtype=torch.int32),
                            torch.tensor(layout.prefill_query_lens, dtype=torch.int32))
        return AttentionMetadata(
            num_decodes=len(layout.decode_tables),
            slot_mapping=torch.tensor(layout.slots, dtype=torch.long, device=device),
            decode_block_tables=tables,
            decode_seq_lens=seq_lens,
            prefill_kernel_args=prefill_args,
            prefill_kernel_dtypes=self.prefill_dtypes if prefill_args is not None else frozenset(),
            decode_groups=[] if tables is not None else build_decode_groups(
                layout.decode_tables, layout.decode_seq_lens, layout.block_size, device, self.group_cost),
            prefill_query_lens=layout.prefill_query_lens,
            prefill_seq_lens=layout.prefill_seq_lens,
            # A chunk with no earlier context attends to its own K/V and reads no blocks.
            prefill_block_ids=[torch.tensor(t if s > q else [], dtype=torch.long, device=device) for t, s, q
                               in zip(layout.prefill_tables, layout.prefill_seq_lens, layout.prefill_query_lens)],
            layout=layout,
            max_seq_len=max(layout.decode_seq_lens + layout.prefill_seq_lens, default=0),
        )

    def forward(self, query, key, value, kv_cache, meta, scale, kv_written=False, window=None, softcap=None):
        """`window`: each query sees only the `window` latest keys, itself included (a sliding
        layer); `softcap`: scores become softcap * tanh(scores / softcap) before the mask. Either
        one, where it changes anything, takes `_masked` instead of the kernels and SDPA."""
        if not kv_written:
            _write_kv(kv_cache, meta.slot_mapping, key, value)
        if softcap is not None or (window is not None and window < meta.max_seq_len):
            return self._masked(query, key, value, kv_cache, meta, scale, window, softcap)
        n = meta.num_decodes
        prefill_kernel = prefill_kernel_takes(meta, query.dtype, query.shape[-1], kv_cache)
        if meta.decode_block_tables is not None or prefill_kernel:  # through the kernels, into `out`
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            if n:
                self.kernels.paged_decode_attention(out[:n], query[:n], kv_cache[0], kv_cache[1],
                                                    meta.decode_block_tables, meta.decode_seq_lens, scale,
                                                    *kv_cache[2:])  # an int8 cache's scales
            if prefill_kernel:
                self.kernels.paged_prefill_attention(out[n:], query[n:], kv_cache[0], kv_cache[1],
                                                     *meta.prefill_kernel_args, scale, *kv_cache[2:],
                                                     key=key[n:], value=value[n:])
            else:
                self._prefill_chunks(query, key, value, kv_cache, meta, n, out, scale)
            return out
        if not meta.decode_groups and len(meta.prefill_query_lens) == 1:
            # A lone prefill chunk: its result as is, without an output buffer and a copy.
            return self._prefill_chunk(query, key, value, kv_cache, 0, meta.prefill_query_lens[0],
                                       meta.prefill_seq_lens[0], meta.prefill_block_ids[0], scale)
        if len(meta.decode_groups) == 1 and not meta.prefill_query_lens:  # one decode group likewise
            return self._decode(query, kv_cache, meta.decode_groups[0], scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        start = 0
        for group in meta.decode_groups:
            end = start + group.num_seqs
            out[start:end] = self._decode(query[start:end], kv_cache, group, scale)
            start = end
        self._prefill_chunks(query, key, value, kv_cache, meta, start, out, scale)
        return out

    def _prefill_chunks(self, query, key, value, kv_cache, meta, start: int, out: torch.Tensor, scale: float) -> None:
        """Every prefill chunk of the step (their tokens start at flat index `start`) into `out`."""
        for q_len, seq_len, block_ids in zip(meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_ids):
            out[start : start + q_len] = self._prefill_chunk(query, key, value, kv_cache, start, q_len, seq_len,
                                                             block_ids, scale)
            start += q_len

    def _prefill_chunk(self, query, key, value, kv_cache, start: int, q_len: int, seq_len: int,
                       block_ids: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the chunk at flat tokens start .. start + q_len - 1 (context: seq_len)."""
        end = start + q_len
        if seq_len == q_len:  # no earlier context: attend within the chunk
            k, v = key[start:end], value[start:end]
        else:
            k, v = _gather(kv_cache, block_ids, query.dtype)
            k, v = k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]
        return self._prefill(query[start:end], k, v, seq_len - q_len, scale)

    @staticmethod
    def _prefill(q, k, v, num_context, scale):
        """Causal attention of a chunk of q_len queries at positions num_context.. over seq_len keys.

        GQA: each KV head is broadcast to its query heads as a zero-stride view, not copied
        (on CPU this is ~3x faster than SDPA's own enable_gqa, which materializes the repeat)."""
        q_len, num_heads, head_dim = q.shape
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = num_heads // num_kv_heads
        q = q.transpose(0, 1).unflatten(0, (num_kv_heads, group))  # [kv_heads, group, q_len, head_dim]
        k = k.transpose(0, 1)[:, None].expand(num_kv_heads, group, seq_len, head_dim)
        v = v.transpose(0, 1)[:, None].expand(num_kv_heads, group, seq_len, head_dim)
        if num_context == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + num_context
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.flatten(0, 1).transpose(0, 1)

    def _masked(self, query, key, value, kv_cache, meta, scale, window, softcap) -> torch.Tensor:
        """Attention with a sliding window and/or soft-capped scores, in PyTorch ops: the decodes
        as one padded batch over just the blocks their windows reach, then each prefill chunk."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        n, layout = meta.num_decodes, meta.layout
        if n:
            if window not in meta.windowed_decodes:
                meta.windowed_decodes[window] = _windowed_tables(layout, window, query.device)
            tables, mask = meta.windowed_decodes[window]
            num_heads, head_dim = query.shape[1:]
            kv_heads = kv_cache[0].shape[2]
            k, v = _gather(kv_cache, tables.view(-1), query.dtype)
            k = k.view(n, -1, kv_heads, head_dim).transpose(1, 2)[:, :, None]  # [n, kv_heads, 1, keys, head_dim]
            v = v.view(n, -1, kv_heads, head_dim).transpose(1, 2)[:, :, None]
            q = query[:n].reshape(n, kv_heads, num_heads // kv_heads, 1, head_dim)
            out[:n] = _attend(q, k, v, mask, scale, softcap).view(n, num_heads, head_dim)
        start = n
        for q_len, seq_len, block_ids in zip(meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_ids):
            end = start + q_len
            if seq_len == q_len:
                k, v = key[start:end], value[start:end]
            else:
                k, v = _gather(kv_cache, block_ids, query.dtype)
                k, v = k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]
            q_len_, num_heads, head_dim = query[start:end].shape
            kv_heads = k.shape[1]
            q = query[start:end].transpose(0, 1).unflatten(0, (kv_heads, num_heads // kv_heads))[None]
            rows = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
            cols = torch.arange(seq_len, device=query.device)[None, :]
            mask = cols <= rows
            if window is not None:
                mask &= cols > rows - window
            o = _attend(q, k.transpose(0, 1)[None, :, None], v.transpose(0, 1)[None, :, None], mask, scale, softcap)
            out[start:end] = o[0].flatten(0, 1).transpose(0, 1)
            start = end
        return out

    @staticmethod
    def _decode(q, kv_cache, group, scale):
        """One query per sequence over its gathered blocks, padded to the group's longest.

        The query heads sharing a KV head are folded into the query-length axis (all sit at the
        same position, so no causal mask is needed), which makes GQA a plain batched SDPA."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = kv_cache[0].shape
        tables = group.block_tables
        max_len = tables.shape[1] * block_size
        k, v = _gather(kv_cache, tables.view(-1), q.dtype)
        k = k.view(num_seqs, max_len, num_kv_heads, head_dim)[:, : group.kv_len].transpose(1, 2)
        v = v.view(num_seqs, max_len, num_kv_heads, head_dim)[:, : group.kv_len].transpose(1, 2)
        q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        return o.reshape(num_seqs, num_heads, head_dim)


def build_decode_groups(tables: list[list[int]], seq_lens: list[int], block_size: int, device,
                        group_cost: int = 12) -> list[DecodeGroup]:
    """The decodes' padded block tables and masks, in groups of similar length (`split_by_length`);
    `tables` are sorted by length, shortest first, and `seq_lens` count the new token."""
    groups = []
    start = 0
    for size in split_by_length([len(t) for t in tables], group_cost):
        end = start + size
        width = len(tables[end - 1])  # the longest of the group
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables[start:end]], dtype=torch.long)
        if size == 1:  # attend exactly its keys: no mask
            groups.append(DecodeGroup(num_seqs=1, block_tables=padded.to(device), kv_len=seq_lens[start], mask=None))
        else:
            lens = torch.tensor(seq_lens[start:end], dtype=torch.long)
            mask = (torch.arange(width * block_size)[None, :] < lens[:, None])[:, None, None, :]
            groups.append(DecodeGroup(num_seqs=size, block_tables=padded.to(device), kv_len=width * block_size, mask=mask.to(device)))
        start = end
    return groups


def split_by_length(lengths: list[int], group_cost: int = 12) -> list[int]:
    """Split ascending `lengths` (in blocks) into consecutive groups, returning their sizes.

    A group costs its padded work, size x its longest length, plus `group_cost` blocks' worth
    for the extra kernel launches of one more group; the split minimizes the total, by dynamic
    programming over the distinct lengths (few, so this stays cheap)."""
    if not lengths:
        return []
    values: list[int] = []  # distinct lengths, ascending, and how many of each
    counts: list[int] = []
    for length in lengths:
        if values and values[-1] == length:
            counts[-1] += 1
        else:
            values.append(length)
            counts.append(1)
    m = len(values)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    best = [0] + [0] * m  # best[j]: cost of the first j distinct values
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        best[j], cut[j] = min((best[i] + (prefix[j] - prefix[i]) * values[j - 1] + group_cost, i) for i in range(j))
    sizes = []
    j = m
    while j:
        sizes.append(prefix[j] - prefix[cut[j]])
        j = cut[j]
    return sizes[::-1]


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """q [b, kv_heads, group, q_len, d] over k, v [b, kv_heads, 1, keys, d] (each KV head serves
    its group of query heads), keys where `mask` (broadcast to [b, 1, 1, q_len, keys]) is True.
    Soft-capped as Gemma 2's reference does it: scores scaled, capped, masked, softmax in fp32."""
    if softcap is None:  # SDPA over [b * kv_heads, group, ...], GQA as zero-stride views
        b, kv_heads, group = q.shape[:3]
        shape = (b, kv_heads, group, k.shape[-2], k.shape[-1])
        mask = mask.expand(b, kv_heads, 1, q.shape[3], k.shape[-2]).flatten(0, 1)
        o = F.scaled_dot_product_attention(q.flatten(0, 1), k.expand(shape).flatten(0, 1), v.expand(shape).flatten(0, 1),
                                           attn_mask=mask, scale=scale)
        return o.unflatten(0, (b, kv_heads))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _windowed_tables(layout: BatchLayout, window: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every decode: the blocks its window reaches, from the one holding its oldest visible
    key, padded with block 0 to the widest ([num_decodes, width] int64), and which of their keys
    it sees ([num_decodes, 1, 1, 1, width * block_size]); `window` None: whole contexts."""
    bs = layout.block_size
    firsts = [0 if window is None else max(0, n - window) // bs for n in layout.decode_seq_lens]
    rows = [t[f:] for t, f in zip(layout.decode_tables, firsts)]
    width = max(len(r) for r in rows)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    lens = torch.tensor(layout.decode_seq_lens)[:, None]
    positions = torch.tensor(firsts)[:, None] * bs + torch.arange(width * bs)[None, :]
    mask = positions < lens
    if window is not None:
        mask &= positions >= lens - window
    return tables.to(device), mask[:, None, None, None, :].to(device)


def chunks_as_decodes(layout: BatchLayout, max_query: int = DECODE_KERNEL_MAX_QUERY) -> BatchLayout:
    """The layout with its leading chunks of at most `max_query` tokens over context already in
    the cache (a request verifying drafts, a short chunk after its prompt) as one decode per
    token: query i of a chunk ending at seq_len sees the keys up to seq_len - q + i, the same
    block table. The flat order stays (decodes, then those chunks' tokens, then the other chunks),
    and each such token is attended as a plain decode of it would be. The paged decode kernel
    reads the context in place; the prefill kernel packs a copy of each chunk's context first,
    which costs more than it saves below about 32 queries (AVX-512 BF16, 2 cores, Qwen2.5-1.5B's
    heads, 500 keys: 4 chunks of 3 queries 1.24 ms through the prefill kernel, 0.23 ms as
    decodes; 1 chunk of 64 queries 0.88 ms, 1.11 ms)."""
    count = 0
    for q, s in zip(layout.prefill_query_lens, layout.prefill_seq_lens):
        if q > max_query or s <= q:
            break
        count += 1
    if not count:
        return layout
    tables, seq_lens = list(layout.decode_tables), list(layout.decode_seq_lens)
    for q, s, table in zip(layout.prefill_query_lens[:count], layout.prefill_seq_lens[:count], layout.prefill_tables):
        for i in range(q):
            seq_len = s - q + 1 + i
            tables.append(table[: -(-seq_len // layout.block_size)])
            seq_lens.append(seq_len)
    return BatchLayout(layout.block_size, layout.slots, tables, seq_lens, layout.prefill_query_lens[count:],
                       layout.prefill_seq_lens[count:], layout.prefill_tables[count:])


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables padded with block 0 to the longest, [len(tables), max_len] int32."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def prefill_kernel_takes(meta: AttentionMetadata, dtype: torch.dtype, head_dim: int, kv_cache) -> bool:
    """Whether this step's prefill chunks go through `paged_prefill_attention`: the backend built
    its arguments (the CPU kernels), and it takes this compute dtype, head size and layer cache
    (queries of a dtype in `prefill_kernel_dtypes`: float32 from AVX2 up, bf16 at AVX-512 BF16;
    a cache of that dtype, float16 under float32, or int8; head size 64 or 128)."""
    if meta.prefill_kernel_args is None:
        return False
    if len(kv_cache) == 4:
        cache_dtypes = (torch.int8,)
    else:
        cache_dtypes = (dtype, torch.float16) if dtype == torch.float32 else (dtype,)
    return dtype in meta.prefill_kernel_dtypes and kv_cache[0].dtype in cache_dtypes and head_dim in (64, 128)


def _write_kv(kv_cache, slot_mapping, key, value) -> None:
    """Store this step's K/V [num_tokens, num_kv_heads, head_dim] at their slots (quantized in a
    4-tensor cache: K and V together, one set of ops for both)."""
    if len(kv_cache) == 2:  # the compute dtype, or float16 under float32 (rounded here)
        key_cache, value_cache = kv_cache
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
        return
    key_codes, value_codes, key_scales, value_scales = kv_cache
    codes, scales = quantize_kv(torch.stack((key, value)), key_codes.dtype)  # [2, n, kv_heads, (head_dim)]
    for cache, x in zip((key_codes, value_codes, key_scales, value_scales), (*codes, *scales)):
        indexable(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, indexable(x))


def _gather(kv_cache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks `block_ids`, in order: [len(block_ids), block_size, num_kv_heads,
    head_dim] each, in the compute dtype `dtype` (dequantized from a 4-tensor cache)."""
    if len(kv_cache) == 2:
        key_cache, value_cache = kv_cache
        return key_cache.index_select(0, block_ids).to(dtype), value_cache.index_select(0, block_ids).to(dtype)
    key_codes, value_codes, key_scales, value_scales = kv_cache
    return (dequantize_kv(key_codes.index_select(0, block_ids), key_scales.index_select(0, block_ids), dtype),
            dequantize_kv(value_codes.index_select(0, block_ids), value_scales.index_select(0, block_ids), dtype))
