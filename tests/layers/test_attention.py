"""The reference attention backend on random data: paged decode (in length groups) and chunked
prefill against plain causal attention over each sequence's contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention import (
    AttentionMetadata, BatchLayout, TorchAttentionBackend, build_decode_groups, split_by_length,
)


def test_split_by_length_balances_padding_against_groups():
    assert split_by_length([]) == []
    assert split_by_length([3, 3, 3]) == [3]
    # One long sequence among short ones gets its own group: padding 20 short ones to 40 blocks
    # costs far more than one more group.
    assert split_by_length([2] * 20 + [40]) == [20, 1]
    # Nearly equal lengths stay together: splitting saves less than a group costs.
    assert split_by_length([10, 10, 11, 11]) == [4]
    # With no per-group cost every distinct length is its own group.
    assert split_by_length([1, 2, 2, 3], group_cost=0) == [1, 2, 1]
    sizes = split_by_length(sorted([5, 9, 1, 30, 31, 2, 17, 8] * 4))
    assert sum(sizes) == 32 and all(s > 0 for s in sizes)


def reference(q, k, v, scale):
    """Causal attention of the last q_len positions of one sequence; GQA by repeating K/V."""
    q_len, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_step(dtype, bs, kv_heads, heads, hd, decode_lens, prefill, seed=0):
    """A paged cache holding each sequence's earlier context (blocks scattered, block 0 unused),
    this step's query/key/value and its BatchLayout; and each sequence's full K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = decode_lens + [s for _, s in prefill]
    q_lens = [1] * len(decode_lens) + [c for c, _ in prefill]
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    key_cache = torch.zeros(num_blocks, bs, kv_heads, hd, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    full_k = [torch.randn(n, kv_heads, hd, generator=g).to(dtype) for n in seq_lens]
    full_v = [torch.randn(n, kv_heads, hd, generator=g).to(dtype) for n in seq_lens]
    new_k, new_v, slots = [], [], []
    for table, n, q_len, k, v in zip(tables, seq_lens, q_lens, full_k, full_v):
        for p in range(n):
            slot = table[p // bs] * bs + p % bs
            if p < n - q_len:
                key_cache.view(-1, kv_heads, hd)[slot] = k[p]
                value_cache.view(-1, kv_heads, hd)[slot] = v[p]
            else:
                slots.append(slot)
        new_k.append(k[n - q_len:])
        new_v.append(v[n - q_len:])
    nd = len(decode_lens)
    layout = BatchLayout(bs, slots, tables[:nd], decode_lens, [c for c, _ in prefill], [s for _, s in prefill], tables[nd:])
    # Queries as the model makes them: rows strided (q and k rotated together), head rows contiguous.
    query = torch.randn(sum(q_lens), heads + kv_heads, hd, generator=g).to(dtype)[:, :heads]
    return (key_cache, value_cache), query, torch.cat(new_k), torch.cat(new_v), layout, full_k, full_v, q_lens


@pytest.mark.parametrize("group_cost", [0, 12, 10**9])  # many groups, some, one
def test_paged_decode_and_chunked_prefill_match_reference(group_cost):
    bs, kv_heads, heads, hd, scale = 4, 2, 6, 8, 0.3
    decode_lens = sorted([1, 3, 4, 5, 9, 16, 17, 30])  # context incl. the new token, ascending
    prefill = [(7, 7), (5, 12)]  # (chunk length, context length incl. the chunk)
    (key_cache, value_cache), query, new_k, new_v, layout, full_k, full_v, q_lens = random_step(
        torch.float32, bs, kv_heads, heads, hd, decode_lens, prefill)
    tables = layout.decode_tables + layout.prefill_tables
    slots = layout.slots
    groups = build_decode_groups(tables[: len(decode_lens)], decode_lens, bs, "cpu", group_cost)
    if group_cost == 0:  # one group per distinct block count
        assert len(groups) == len({-(-n // bs) for n in decode_lens})
    if group_cost == 10**9:
        assert len(groups) == 1
    meta = AttentionMetadata(
        num_decodes=len(decode_lens), slot_mapping=torch.tensor(slots), decode_groups=groups,
        prefill_query_lens=[c for c, _ in prefill], prefill_seq_lens=[s for _, s in prefill],
        prefill_block_ids=[torch.tensor(t) for t in tables[len(decode_lens):]],
    )
    out = TorchAttentionBackend().forward(query, new_k, new_v, (key_cache, value_cache), meta, scale)
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
