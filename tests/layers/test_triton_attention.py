"""The Triton attention kernels against the PyTorch reference backend, over a grid of shapes:
context lengths crossing block boundaries, block sizes, GQA ratios (MHA, 3:1 as in the default
model, MQA: the prefill tile holds a KV head's whole query group), head sizes that are not
powers of two, decode splits, sliding windows and soft-capped scores, fp32 / fp16 / bf16 and
an int8 / fp8 KV cache. Without a GPU they run in Triton's CPU interpreter (tests/conftest.py),
at sizes kept small for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tokenmill.layers.attention import BatchLayout, TorchAttentionBackend  # noqa: E402
from tokenmill.layers.attention.kv_quant import KV_CODE_DTYPES, quantize_kv  # noqa: E402
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, decode_num_splits  # noqa: E402
from tokenmill.layers.attention import triton_kernels  # noqa: E402
from tokenmill.layers.attention.triton_kernels import dot_precision, paged_decode, paged_prefill, write_kv  # noqa: E402

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


def run(backend, query, key, value, kv_cache, layout, scale, device, **scores):
    """The backend's output and cache after the step; `scores`: window= / softcap= (a sliding,
    soft-capped layer)."""
    cache = tuple(c.to(device, copy=True) for c in kv_cache)
    meta = backend.build_metadata(layout, torch.device(device))
    out = backend.forward(query.to(device), key.to(device), value.to(device), cache, meta, scale, **scores)
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
    # fresh, chunked, chunked, and a chunk of two query tiles where a tile is 64 rows of 16 or 21
    # positions (MQA, 3:1)
    prefill = [(9, 9), (5, 5 + 2 * block_size + 3), (1 + block_size, 40 + block_size), (23, 23 + block_size)]
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


def poison_before(kv_cache, tables, firsts, block_size):
    """A copy of the (unquantized) cache with NaN keys and values at each sequence's positions
    before firsts[i]: a kernel that reads any of them, masked or not, spreads NaN to the output
    (masked scores drop a NaN key, but not a NaN value: 0 * NaN)."""
    poisoned = tuple(c.clone() for c in kv_cache)
    for table, first in zip(tables, firsts):
        for pos in range(max(0, first)):
            for cache in poisoned:
                cache[table[pos // block_size], pos % block_size] = float("nan")
    return poisoned


SCORE_CASES = [  # window, softcap
    (7, None),  # shorter than most contexts, its start crossing block boundaries
    (None, 1.5),
    (20, 2.0),
    (1000, None),  # longer than every context: no key is left out
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs%d-kv%d-h%d-d%d" % s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window, softcap", SCORE_CASES, ids=lambda x: str(x))
def test_window_and_softcap_match_torch_backend(shape, dtype, window, softcap):
    """Decodes (some with their window starting mid-block) and prefill chunks - fresh, and
    chunked over earlier context longer than the window - against the masked reference."""
    block_size, kv_heads, heads, head_dim = shape
    decode_lens = [1, block_size + 1, 3 * block_size - 1, 70]
    prefill = [(9, 9), (5, 5 + 2 * block_size + 3), (23, 23 + block_size)]
    query, key, value, kv_cache, layout = make_step(4, block_size, kv_heads, heads, head_dim, dtype, decode_lens, prefill)
    scale = head_dim**-0.5
    scores = dict(window=window, softcap=softcap)
    expected, _ = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, scale, "cpu", **scores)
    out, _ = run(TritonAttentionBackend(), query, key, value, kv_cache, layout, scale, DEVICE, **scores)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_windowed_split_k_decode_reads_only_the_window(num_splits):
    """The splits cut [seq_len - window, seq_len): keys before the window are never read (here
    they are NaN in the cache, which any read would spread to the output); empty splits weigh
    nothing."""
    window, softcap = 40, 3.0
    query, key, value, kv_cache, layout = make_step(5, 16, 2, 6, 32, torch.float32, [1, 5, 17, 33, 100], [])
    expected, _ = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.2, "cpu", window=window,
                      softcap=softcap)
    poisoned = poison_before(kv_cache, layout.decode_tables, [n - window for n in layout.decode_seq_lens], 16)
    meta = TritonAttentionBackend().build_metadata(layout, torch.device(DEVICE))
    cache = tuple(c.to(DEVICE, copy=True) for c in poisoned)
    write_kv(key.to(DEVICE), value.to(DEVICE), meta.slot_mapping, cache)
    out = torch.empty(query.shape, device=DEVICE)
    paged_decode(query.to(DEVICE), cache, meta.decode_block_tables, meta.decode_seq_lens, 0.2, num_splits, out,
                 tile_n=16, window=window, softcap=softcap)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_heads, heads", [(2, 2), (3, 9), (1, 9)], ids=["mha", "gqa3", "mqa9"])
@pytest.mark.parametrize("window, softcap", [(None, None), (10, None), (6, 1.5)], ids=lambda x: str(x))
def test_prefill_small_tiles(kv_heads, heads, window, softcap):
    """Tiles of 16 rows and 16 keys, so chunks span several query tiles and windows skip whole
    key tiles: 16 rows hold 16 positions x 1 head (MHA), 5 x 3 with one idle row (3:1), or
    1 x 9 with seven idle rows (a group of 9 padded to 16). No key before the window of a
    chunk's first query is read (they are NaN here): the blocks a sliding window left behind may
    hold anything."""
    chunks = [(30, 30), (19, 19 + 37), (1, 50)]  # fresh, chunked over earlier context, a lone query
    query, key, value, kv_cache, layout = make_step(6, 8, kv_heads, heads, 16, torch.float32, [], chunks)
    scores = dict(window=window, softcap=softcap)
    expected, _ = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.3, "cpu", **scores)
    if window is not None:
        firsts = [s - q - window + 1 for q, s in zip(layout.prefill_query_lens, layout.prefill_seq_lens)]
        kv_cache = poison_before(kv_cache, layout.prefill_tables, firsts, 8)
    meta = TritonAttentionBackend().build_metadata(layout, torch.device(DEVICE))
    cache = tuple(c.to(DEVICE, copy=True) for c in kv_cache)
    write_kv(key.to(DEVICE), value.to(DEVICE), meta.slot_mapping, cache)
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    paged_prefill(query.to(DEVICE), cache, meta.prefill_block_tables, meta.prefill_query_start, meta.prefill_seq_lens,
                  meta.prefill_max_query_len, 0.3, out, tile_rows=16, block_n=16, **scores)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_int8_kv_cache_with_window_and_softcap():
    """Every row has earlier context, so the reference reads the same dequantized keys."""
    decode_lens, prefill = [1, 17, 40], [(4, 30), (6, 20)]
    query, key, value, kv_cache, layout = make_step(7, 16, 3, 9, 64, torch.float32, decode_lens, prefill, "int8")
    scores = dict(window=9, softcap=1.5)
    expected, _ = run(TorchAttentionBackend(), query, key, value, kv_cache, layout, 0.125, "cpu", **scores)
    out, _ = run(TritonAttentionBackend(), query, key, value, kv_cache, layout, 0.125, DEVICE, **scores)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, triton_kernels._tanh(tl.load(x_ptr + i)))


def test_tanh_is_accurate_near_zero_and_saturates():
    """The soft-cap's tanh within a few float32 ulps of torch's, tiny arguments (where 1 - e**-2x
    cancels) and huge ones (where e**2x would overflow) included."""
    x = torch.cat([torch.logspace(-8, 2, 60), torch.tensor([0.0, 0.1249, 0.125, 1e4])])
    x = torch.cat([x, -x])
    y = torch.empty(x.shape, device=DEVICE)
    _tanh_kernel[(1,)](x.to(DEVICE), y, N=x.numel())
    torch.testing.assert_close(y.cpu(), torch.tanh(x), atol=0, rtol=5e-7)


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreter", "compiled"])
def test_dot_precision_follows_the_users_tf32_setting(compiled, monkeypatch):
    """TF32 only compiled, for float32 queries, where the user allowed it in PyTorch."""
    monkeypatch.setattr(triton_kernels, "interpreting", lambda: not compiled)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # PyTorch's default
        assert [dot_precision(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["ieee"] * 3
        for allowed in ("high", "medium"):
            torch.set_float32_matmul_precision(allowed)
            assert dot_precision(torch.float32) == ("tf32" if compiled else "ieee")
            assert dot_precision(torch.bfloat16) == "ieee"
    finally:
        torch.set_float32_matmul_precision(old)
    # The settings as torch >= 2.9 reports them (the new API, which the legacy one also sets) ...
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision="tf32"))
    assert dot_precision(torch.float32) == ("tf32" if compiled else "ieee")
    # ... and as older versions do.
    legacy = SimpleNamespace(allow_tf32=True)
    monkeypatch.setattr(torch.backends.cuda, "matmul", legacy)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert dot_precision(torch.float32) == ("tf32" if compiled else "ieee")
    legacy.allow_tf32 = False
    assert dot_precision(torch.float32) == "ieee"
