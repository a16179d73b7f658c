"""tokenmill's compiled CPU kernels (layers/cpu_kernels.py) against PyTorch: the torch attention
backend with its decode kernel over a grid of shapes (GQA ratios, block sizes, head sizes with
and without a specialized build, contexts crossing block boundaries, decodes mixed with prefill
chunks), and RMSNorm against F.rms_norm. Skipped where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.layers.test_attention import reference
from tokenmill.layers import cpu_kernels
from tokenmill.layers.attention import BatchLayout, TorchAttentionBackend

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"CPU kernels not built here: {cpu_kernels.build_error()}")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 8), (4, 4, 64), (8, 1, 128), (9, 3, 64)])
@pytest.mark.parametrize("bs", [4, 16])
def test_decode_kernel_matches_the_reference(dtype, heads, kv_heads, hd, bs):
    decode_lens = sorted([1, 3, bs, bs + 1, 2 * bs - 1, 5 * bs + 3, 40])  # ascending, crossing block ends
    prefill = [(7, 7), (5, 2 * bs + 5)]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(dtype, bs, kv_heads, heads, hd, decode_lens,
                                                                          prefill)
    backend = TorchAttentionBackend(decode_kernel=kernels)
    meta = backend.build_metadata(layout, "cpu")
    assert meta.decode_groups == [] and meta.decode_block_tables.dtype == torch.int32
    out = backend.forward(query, key, value, cache, meta, 0.3)
    expected = torch.cat([reference(q.float(), k.float(), v.float(), 0.3)
                          for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # the same step without the kernel: the gathered-SDPA path agrees
    cache2, *_ = random_step(dtype, bs, kv_heads, heads, hd, decode_lens, prefill)
    plain = TorchAttentionBackend()
    ref_out = plain.forward(query, key, value, cache2, plain.build_metadata(layout, "cpu"), 0.3)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


def test_decode_only_step_and_a_lone_decode():
    for decode_lens in ([50], [2, 17, 33, 200]):
        cache, query, key, value, layout, full_k, full_v, q_lens = random_step(torch.float32, 16, 3, 9, 64,
                                                                              decode_lens, [])
        backend = TorchAttentionBackend(decode_kernel=kernels)
        out = backend.forward(query, key, value, cache, backend.build_metadata(layout, "cpu"), 0.125)
        expected = torch.cat([reference(q, k, v, 0.125) for q, k, v in zip(query.split(q_lens), full_k, full_v)])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_kernel_refuses_bad_arguments():
    cache, query, key, value, layout, *_ = random_step(torch.float32, 4, 2, 6, 8, [5], [])
    tables = torch.tensor([layout.decode_tables[0]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    out = torch.empty(1, 6, 8)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_decode_attention(out, query, *cache, tables.long(), lens, 0.3)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.paged_decode_attention(out.bfloat16(), query.bfloat16(), *cache, tables, lens, 0.3)
    with pytest.raises(RuntimeError, match=">= 1"):
        kernels.paged_decode_attention(out, query, *cache, tables, torch.zeros(1, dtype=torch.int32), 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (300, 1536)])
def test_rms_norm_matches_f_rms_norm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    expected = F.rms_norm(x.float(), (hidden,), w.float(), 1e-5)
    got = kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # rounded once to bf16: within one bf16 step of the fp32 result
        assert ((got.float() - expected).abs() <= expected.abs() * 2**-7 + 1e-6).all()
