"""tokenmill's compiled CPU kernels (layers/cpu_kernels.py) against PyTorch: the torch attention
backend with its decode kernel over a grid of shapes (GQA ratios, block sizes, head sizes with
and without a specialized build, contexts crossing block boundaries, decodes mixed with prefill
chunks), and RMSNorm against F.rms_norm. Skipped where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.layers.test_attention import random_step, reference
from tokenmill.layers import cpu_kernels
from tokenmill.layers.attention import TorchAttentionBackend

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"CPU kernels not built here: {cpu_kernels.build_error()}")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


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
