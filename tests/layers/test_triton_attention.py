"""The Triton attention kernels against the PyTorch reference backend, over a grid of shapes:
context lengths crossing block boundaries, block sizes, GQA ratios (MHA, 3:1 as in the default
model, MQA), head sizes that are not powers of two, decode splits, fp32 / fp16 / bf16 and an
int8 / fp8 KV cache. Without a GPU they run in Triton's CPU interpreter (tests/conftest.py),
at sizes kept small for it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers.attention import BatchLayout, TorchAttentionBackend  # noqa: E402
from tokenmill.layers.attention.kv_quant import KV_CODE_DTYPES, quantize_kv  # noqa: E402
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, decode_num_splits  # noqa: E402
from tokenmill.layers.attention.triton_kernels import paged_decode, write_kv  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(seed, block_size, kv_heads, heads, head_dim, dtype, decode_lens, prefill, kv_dtype="auto"):
    """A random step over a paged cache whose blocks are shuffled: decodes (context lengths incl.
    the new token) then prefill chunks (chunk length, context length incl. the chunk). Earlier
    context is already in the cache; the step's own K/V come in as key/value.
    Returns (query, key, value, kv_cache, layout)."""
    gen = torch.Generator().manual_seed(seed)
    decode_lens = sorted(decode_lens)
    seq_lens = decode_lens + [s for _, s in prefill]
    q_lens = [1] * len(decode_lens) + [c for c, _ in prefill]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays unused
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    full = torch.randn((2, num_blocks * block_size, kv_heads, head_dim), generator=gen).to(dtype)
    if kv_dtype == "auto":
        kv_cache = tuple(x.view(shape).clone() for x in full)
    else:
        codes, scales = quantize_kv(full, KV_CODE_DTYPES[kv_dtype])
        kv_cache = (codes[0].view(shape).clone(), codes[1].view(shape).clone(),
                    scales[0].view(shape[:-1]).clone(), scales[1].view(shape[:-1]).clone())
    slots = [t[p // block_size] * block_size + p % block_size
             for t, n, q in zip(tables, seq_lens, q_lens) for p in range(n - q, n)]
    num_tokens = sum(q_lens)
    query = torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype)
    kv = torch.randn((num_tokens, kv_heads, 2 * head_dim), generator=gen).to(dtype)
    key, value = kv[..., :head_dim], kv[..., head_dim:]  # strided views, as from a fused projection
    layout = BatchLayout(block_size, slots, tables[: len(decode_lens)], decode_lens, q_lens[len(decode_lens):],
                         seq_lens[len(decode_lens):], tables[len(decode_lens):])
    return query, key, value, kv_cache, layout


def run(backend, query, key, value, kv_cache, layout, scale, device):
    cache = tuple(c.to(device, copy=True) for c in kv_cache)
    meta = backend.build_metadata(layout, torch.device(device))
    out = backend.forward(query.to(device), key.to(device), value.to(device), cache, meta, scale)
    return out.cpu(), tuple(c.cpu() for c in cache)


SHAPES = [  # block_size, kv_heads, heads, head_dim
    (16, 3, 9, 64),  # the default model's GQA 3:1
    (4, 2, 2, 32),  # MHA, small blocks: a key tile spans several blocks
    (32, 1, 4, 16),  # MQA
    (8, 2, 4, 40),  # a head size that is not a power of two
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs%d-kv%d-h%d-d%d" % s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_backend_matches_torch_backend(shape, dtype):
    block_size, kv_heads, heads, head_dim = shape
    decode_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 70]
    prefill = [(9, 9), (5, 5 + 2 * block_size + 3), (1 + block_size, 40 + block_size)]  # fresh, chunked, chunked
    query, key, value, kv_cache, layout = make_step(0, block_size, kv_heads, heads, head_dim, dtype, decode_lens, prefill)
    scale = head_dim**-0.5
    expected, expected_cache = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, scale, "cpu")
    out, cache = run(TritonAttentionBackend(), query, key, value, kv_cache, layout, scale, DEVICE)
    for got, want in zip(cache, expected_cache):  # the KV write: exact
        assert torch.equal(got, want)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_k_decode_combines_to_the_same_result(num_splits):
    """More splits than a sequence has key tiles leaves some empty: they must weigh nothing."""
    query, key, value, kv_cache, layout = make_step(1, 16, 2, 6, 32, torch.float32, [1, 5, 17, 33, 100], [])
    expected, _ = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.2, "cpu")
    meta = TritonAttentionBackend().build_metadata(layout, torch.device(DEVICE))
    cache = tuple(c.to(DEVICE, copy=True) for c in kv_cache)
    write_kv(key.to(DEVICE), value.to(DEVICE), meta.slot_mapping, cache)
    out = torch.empty(query.shape, device=DEVICE)
    paged_decode(query.to(DEVICE), cache, meta.decode_block_tables, meta.decode_seq_lens, 0.2, num_splits, out, tile_n=16)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_padding_rows_of_a_captured_batch():
    """A decode row of length 0 gets zeros and a slot of -1 writes nothing: how a batch padded
    to a captured size runs."""
    query, key, value, kv_cache, layout = make_step(2, 16, 1, 2, 16, torch.float32, [5, 20], [])
    expected, expected_cache = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.25, "cpu")
    padded = BatchLayout(16, layout.slots + [-1], layout.decode_tables + [[]], layout.decode_seq_lens + [0], [], [], [])
    pad = lambda t: torch.cat([t, torch.ones_like(t[:1])])  # noqa: E731
    out, cache = run(TritonAttentionBackend(), pad(query), pad(key), pad(value), kv_cache, padded, 0.25, DEVICE)
    torch.testing.assert_close(out[:2], expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for got, want in zip(cache, expected_cache):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache(kv_dtype):
    """int8 / fp8 codes with per token-head scales: the write kernel stores exactly what
    `kv_quant.quantize_kv` computes, and attention reads the dequantized cache as the reference
    does. The one difference by design: the reference attends a chunk with no earlier context
    to its own unquantized K/V, the kernel reads them back from the cache."""
    decode_lens, prefill = [1, 17, 40], [(4, 30), (6, 6)]
    query, key, value, kv_cache, layout = make_step(3, 16, 3, 9, 64, torch.float32, decode_lens, prefill, kv_dtype)
    expected, expected_cache = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.125, "cpu")
    out, cache = run(TritonAttentionBackend(), query, key, value, kv_cache, layout, 0.125, DEVICE)
    for got, want in zip(cache, expected_cache):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    fresh = len(decode_lens) + prefill[0][0]  # the rows of the chunk without context come last
    torch.testing.assert_close(out[:fresh], expected[:fresh], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[fresh:], expected[fresh:], atol=0.15, rtol=0)


def test_decode_split_heuristic():
    assert decode_num_splits(1, 2, 4096, 132) == 16  # batch 1, long context: split to fill the GPU
    assert decode_num_splits(1, 2, 200, 132) == 2  # ... but no split shorter than 128 keys
    assert decode_num_splits(256, 8, 4096, 132) == 1  # enough programs already
    assert decode_num_splits(0, 2, 0, 132) == 1
