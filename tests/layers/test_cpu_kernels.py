"""tokenmill's compiled CPU kernels (layers/cpu_kernels.py) against PyTorch: the torch attention
backend with its decode kernel over a grid of shapes (GQA ratios, block sizes, head sizes with
and without a specialized build, contexts crossing block boundaries, decodes mixed with prefill
chunks), its prefill kernel likewise (bf16, and fp32 at every level from avx2 up: fresh prompts,
chunks after earlier context), RMSNorm against F.rms_norm (and with the residual add before it),
and the rotary embedding + KV store against RotaryEmbedding.apply + index_copy_. Skipped where the
kernels cannot be built."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.layers.levels import kernel_test_levels
from tests.layers.test_attention import random_step, reference
from tokenmill.layers import cpu_kernels
from tokenmill.layers.attention import TorchAttentionBackend, prefill_kernel_takes
from tokenmill.layers.attention.kv_quant import dequantize_kv, quantize_kv
from tokenmill.layers.linear import INT6_GEMM_MIN_ROWS
from tokenmill.layers.rotary import RotaryEmbedding

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"CPU kernels not built here: {cpu_kernels.build_error()}")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def test_a_killed_build_does_not_block_the_next_load_and_a_live_one_is_waited_for():
    """torch's build lock is a bare file: one left by a killed build used to make every later load
    wait forever. A fresh process loads anyway (removing it) once no live process holds the
    build folder's advisory lock, and waits while one does."""
    import fcntl

    folder = cpu_kernels.build_directory(kernels.isa())
    load = [sys.executable, "-c", "import pathlib; from tokenmill.layers import cpu_kernels; "
            "cpu_kernels.PREBUILT = pathlib.Path('/nonexistent'); "  # (the compiled-at-first-use path)
            f"assert cpu_kernels.load({kernels.isa()!r}) is not None"]
    (folder / "lock").touch()
    with open(folder / "tokenmill.lock", "a") as live_builder:
        fcntl.flock(live_builder, fcntl.LOCK_EX)
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(load, timeout=10)
        assert (folder / "lock").exists()
    subprocess.run(load, timeout=180, check=True)
    assert not (folder / "lock").exists()


def _load_in_a_process_that_cannot_compile(isa: str, folder: Path) -> subprocess.CompletedProcess:
    """cpu_kernels.load(isa) in a fresh process whose compiler step raises, prebuilt modules
    looked for in `folder`: prints the loaded module's file, or None and the build error."""
    code = (
        "import pathlib, torch.utils.cpp_extension as ce\n"
        "def no_compiler(*args, **kwargs): raise RuntimeError('error: g++: command not found')\n"
        "ce.load = no_compiler\n"
        "from tokenmill.layers import cpu_kernels\n"
        f"cpu_kernels.PREBUILT = pathlib.Path({str(folder)!r})\n"
        f"module = cpu_kernels.load({isa!r})\n"
        f"print(module.__file__ if module else None, cpu_kernels.build_error({isa!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)


def test_prebuilt_kernels_load_without_a_compiler_and_stale_ones_are_not_used(tmp_path):
    """What `tokenmill build-kernels` (make setup) leaves in the package loads in a process that
    cannot compile; a module whose fingerprint does not match the sources and versions is not
    loaded, and without a compiler the warning names what to install."""
    isa = kernels.isa()
    path = cpu_kernels.prebuilt_path(isa)
    stamp = path.with_suffix(".sha256")
    if not (path.is_file() and stamp.is_file() and stamp.read_text().strip() == cpu_kernels.fingerprint(isa)):
        path = cpu_kernels.build_prebuilt(isa, tmp_path / "built")  # (make setup was not run here)
    got = _load_in_a_process_that_cannot_compile(isa, path.parent)
    assert got.stdout.split()[0] == str(path), got
    stale = tmp_path / "stale"
    stale.mkdir()
    shutil.copy(path, stale / path.name)
    (stale / stamp.name).write_text("0" * 64 + "\n")
    got = _load_in_a_process_that_cannot_compile(isa, stale)
    assert got.stdout.startswith("None RuntimeError: error: g++: command not found"), got
    assert "apt-get install g++" in got.stderr and "pip install ninja" in got.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 8), (4, 4, 64), (8, 1, 128), (9, 3, 64)])
@pytest.mark.parametrize("bs", [4, 16])
def test_decode_kernel_matches_the_reference(dtype, heads, kv_heads, hd, bs):
    decode_lens = sorted([1, 3, bs, bs + 1, 2 * bs - 1, 5 * bs + 3, 40])  # ascending, crossing block ends
    prefill = [(7, 7), (5, 2 * bs + 5)]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(dtype, bs, kv_heads, heads, hd, decode_lens,
                                                                          prefill)
    backend = TorchAttentionBackend(kernels=kernels)
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
        backend = TorchAttentionBackend(kernels=kernels)
        out = backend.forward(query, key, value, cache, backend.build_metadata(layout, "cpu"), 0.125)
        expected = torch.cat([reference(q, k, v, 0.125) for q, k, v in zip(query.split(q_lens), full_k, full_v)])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_over_cached_context_are_attended_as_decodes(dtype):
    """Requests verifying drafts (chunks of a few tokens after their context) right after the
    decodes go through the decode kernel, one decode per token, each seeing the keys up to its
    own position; conversion stops at the first chunk that is long or has no earlier context,
    which with every chunk after it stays a chunk. The step's result is causal attention still."""
    decode_lens = [3, 40]
    prefill = [(3, 40), (5, 130), (1, 20), (64, 64), (2, 50)]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(dtype, 16, 2, 12, 128, decode_lens,
                                                                          prefill)
    backend = TorchAttentionBackend(kernels=kernels)
    meta = backend.build_metadata(layout, "cpu")
    assert meta.num_decodes == 2 + 3 + 5 + 1
    assert meta.decode_seq_lens.tolist() == [3, 40, 38, 39, 40, 126, 127, 128, 129, 130, 20]
    assert [len(t) for t in meta.layout.decode_tables] == [1, 3, 3, 3, 3, 8, 8, 8, 9, 9, 2]
    assert meta.prefill_query_lens == [64, 2] and meta.prefill_seq_lens == [64, 50]
    out = backend.forward(query, key, value, cache, meta, 128**-0.5)
    expected = torch.cat([reference(q.float(), k.float(), v.float(), 128**-0.5)
                          for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)

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
    # no sequences: nothing to do
    kernels.paged_decode_attention(out[:0], query[:0], *cache, tables[:0], lens[:0], 0.3)


prefill_kernel = pytest.mark.skipif(kernels is None or torch.bfloat16 not in kernels.prefill_attention_dtypes(),
                                    reason="the bf16 paged_prefill_attention is not built here (needs AVX-512 BF16)")


@prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 64), (8, 1, 128), (32, 8, 128)])
@pytest.mark.parametrize("bs", [5, 16])
def test_prefill_kernel_matches_the_reference(heads, kv_heads, hd, bs):
    """Every bf16 prefill chunk of a step in one paged_prefill_attention call: a fresh 200-token
    prompt (many 64-key blocks and row tiles, the causal edge inside them), chunks after earlier
    context (chunked prefill, prefix hits), a single-token prompt and a 1-token chunk, next to
    decodes. Within bf16 rounding of the fp32 reference, and as close to it as PyTorch's bf16
    SDPA (the kernel's P is rounded to bf16 before P V, as SDPA's is); identical on 1 and 2
    threads (each row is computed whole by one thread)."""
    prefill = [(200, 200), (70, 300), (1, 1), (1, 130), (33, 97)]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(torch.bfloat16, bs, kv_heads, heads, hd,
                                                                          [3, 40], prefill)
    backend = TorchAttentionBackend(kernels=kernels)
    meta = backend.build_metadata(layout, "cpu")
    tables, seq_lens, query_lens = meta.prefill_kernel_args
    assert tables.dtype == seq_lens.dtype == query_lens.dtype == torch.int32
    assert query_lens.tolist() == [c for c, _ in prefill]
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            outs[n] = backend.forward(query, key, value, tuple(t.clone() for t in cache), meta, hd**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1], outs[2])
    expected = torch.cat([reference(q.float(), k.float(), v.float(), hd**-0.5)
                          for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    torch.testing.assert_close(outs[2].float(), expected, atol=2e-2, rtol=2e-2)
    plain = TorchAttentionBackend()
    sdpa = plain.forward(query, key, value, tuple(t.clone() for t in cache), plain.build_metadata(layout, "cpu"), hd**-0.5)
    ours_err, sdpa_err = ((x.float() - expected).abs().mean().item() for x in (outs[2], sdpa))
    assert ours_err <= 1.2 * sdpa_err, (ours_err, sdpa_err)


@prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 1, 128)])
def test_prefill_kernel_reads_an_int8_cache(heads, kv_heads, hd):
    """kv_cache_dtype int8: a chunk after earlier context attends to the cache's codes times
    their scales (its own tokens too, written quantized first), a fresh prompt to its own
    full-precision K/V, as the SDPA path does; the kernel agrees with that path and with the
    reference over the same values."""
    prefill = [(100, 100), (40, 170), (1, 65)]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(torch.bfloat16, 16, kv_heads, heads, hd,
                                                                          [7], prefill)
    (key_codes, key_scales), (value_codes, value_scales) = (quantize_kv(c, torch.int8) for c in cache)
    cache = (key_codes, value_codes, key_scales, value_scales)
    backend, plain = TorchAttentionBackend(kernels=kernels), TorchAttentionBackend()
    meta = backend.build_metadata(layout, "cpu")
    assert meta.prefill_kernel_args is not None
    out = backend.forward(query, key, value, tuple(t.clone() for t in cache), meta, 0.125)
    sdpa = plain.forward(query, key, value, tuple(t.clone() for t in cache), plain.build_metadata(layout, "cpu"), 0.125)
    lossy = lambda x: dequantize_kv(*quantize_kv(x, torch.int8), torch.bfloat16)  # noqa: E731
    expected = []
    for i, (q, k, v) in enumerate(zip(query.split(q_lens), full_k, full_v)):
        seq_len, q_len = k.shape[0], q.shape[0]
        if i == 0 or seq_len > q_len:  # the decode and chunks after context read the cache
            k, v = lossy(k), lossy(v)
        expected.append(reference(q.float(), k.float(), v.float(), 0.125))
    expected = torch.cat(expected)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), sdpa.float(), atol=2e-2, rtol=2e-2)
    ours_err, sdpa_err = ((x.float() - expected).abs().mean().item() for x in (out, sdpa))
    assert ours_err <= 1.2 * sdpa_err, (ours_err, sdpa_err)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 64)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, d = ((torch.randn(rows, hidden, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    total, normed = kernels.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(total, x + d)  # rounded to the dtype as PyTorch's add rounds
    assert torch.equal(normed, kernels.rms_norm(x + d, w, 1e-6))
    with pytest.raises(RuntimeError, match="delta"):
        kernels.add_rms_norm(x, d[:, :-1], w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd,n", [(9, 3, 64, 1), (9, 3, 64, 37), (4, 4, 8, 5), (8, 1, 128, 20)])
def test_rope_write_kv_matches_rotary_apply_and_the_cache_store(dtype, heads, kv_heads, hd, n):
    """What LlamaAttention does without the kernel: RotaryEmbedding.apply on the q/k part of the
    fused qkv output, then k and v stored at their slots. Bit-identical (the kernel rounds each
    product and the sum as the PyTorch ops do, no fused multiply-add); slot -1 rows (padding)
    are rotated but not stored."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(hd, 4096, 10000.0, None, dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd + 8, dtype=dtype)[:, 8:]  # strided rows, as a slice
    positions = torch.randint(0, 4096, (n,))
    cos_sin = rotary.lookup(positions)
    num_blocks, block_size = 12, 16
    slots = torch.randperm(num_blocks * block_size)[:n]
    if n > 1:
        slots[-1] = -1
    caches = [torch.zeros(num_blocks, block_size, kv_heads, hd, dtype=dtype) for _ in range(2)]
    qk = kernels.rope_write_kv(qkv, *cos_sin, slots, *caches, heads, kv_heads)

    expected = rotary.apply(qkv[:, : (heads + kv_heads) * hd].reshape(n, heads + kv_heads, hd), cos_sin)
    torch.testing.assert_close(qk, expected, atol=0, rtol=0)
    stored = slots >= 0
    qk, qkv, slots = qk[stored], qkv[stored], slots[stored]
    stored_k, stored_v = (c.view(-1, kv_heads, hd)[slots] for c in caches)
    torch.testing.assert_close(stored_k, qk[:, heads:], atol=0, rtol=0)
    torch.testing.assert_close(stored_v, qkv[:, (heads + kv_heads) * hd :].reshape(-1, kv_heads, hd), atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not caches[0].view(-1, kv_heads, hd)[untouched].any() and not caches[1].view(-1, kv_heads, hd)[untouched].any()


def test_rope_write_kv_refuses_bad_arguments():
    cos_sin = RotaryEmbedding(8, 64, 10000.0, None, torch.float32).lookup(torch.arange(2))
    qkv = torch.randn(2, (4 + 2 * 2) * 8)
    caches = [torch.zeros(3, 4, 2, 8) for _ in range(2)]
    for bad in (12, -2):
        with pytest.raises(RuntimeError, match="slot out of the cache's range"):
            kernels.rope_write_kv(qkv, *cos_sin, torch.tensor([0, bad]), *caches, 4, 2)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.rope_write_kv(qkv, *cos_sin, torch.tensor([0, 1], dtype=torch.int32), *caches, 4, 2)
    with pytest.raises(RuntimeError, match="qkv"):
        kernels.rope_write_kv(qkv[:, :-8], *cos_sin, torch.tensor([0, 1]), *caches, 4, 2)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rope_write_kv(qkv.bfloat16(), *cos_sin, torch.tensor([0, 1]), *caches, 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 8), (9, 3, 64), (8, 1, 128)])
def test_decode_kernel_reads_an_int8_cache(dtype, heads, kv_heads, hd):
    """kv_cache_dtype int8: the kernel reads codes and per-token-head scales in place and agrees
    with the PyTorch path, which dequantizes the gathered blocks (the same cache, the same step)."""
    bs = 16
    decode_lens = sorted([1, 3, 16, 17, 40, 5 * bs + 3])
    cache, query, key, value, layout, *_ = random_step(dtype, bs, kv_heads, heads, hd, decode_lens, [(5, 2 * bs + 5)])
    (key_codes, key_scales), (value_codes, value_scales) = (quantize_kv(c, torch.int8) for c in cache)
    quantized = (key_codes, value_codes, key_scales, value_scales)
    backend = TorchAttentionBackend(kernels=kernels)
    out = backend.forward(query, key, value, tuple(t.clone() for t in quantized), backend.build_metadata(layout, "cpu"), 0.3)
    plain = TorchAttentionBackend()
    expected = plain.forward(query, key, value, tuple(t.clone() for t in quantized), plain.build_metadata(layout, "cpu"), 0.3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="both or neither"):
        kernels.paged_decode_attention(out[:1], query[:1], key_codes, value_codes, backend.build_metadata(layout, "cpu").decode_block_tables[:1],
                                       torch.tensor([1], dtype=torch.int32), 0.3, key_scales)



@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 8), (9, 3, 64), (8, 1, 128)])
def test_decode_kernel_reads_a_float16_cache(heads, kv_heads, hd):
    """kv_cache_dtype float16 under float32 compute: the kernel widens the cached rows in place
    (F16C) and agrees with the PyTorch path, which widens the gathered blocks (the same cache,
    the same step, a prefill chunk after context in it too); bf16 queries are refused."""
    bs = 16
    decode_lens = sorted([1, 3, 16, 17, 40, 5 * bs + 3])
    cache, query, key, value, layout, *_ = random_step(torch.float32, bs, kv_heads, heads, hd, decode_lens,
                                                       [(5, 2 * bs + 5)])
    half = tuple(c.half() for c in cache)
    backend = TorchAttentionBackend(kernels=kernels)
    meta = backend.build_metadata(layout, "cpu")
    out = backend.forward(query, key, value, tuple(t.clone() for t in half), meta, 0.3)
    plain = TorchAttentionBackend()
    expected = plain.forward(query, key, value, tuple(t.clone() for t in half), plain.build_metadata(layout, "cpu"), 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    n = len(decode_lens)
    with pytest.raises(RuntimeError, match="float16 under float32"):
        kernels.paged_decode_attention(out[:n].bfloat16(), query[:n].bfloat16(), *half, meta.decode_block_tables,
                                       meta.decode_seq_lens, 0.3)


def test_rope_write_kv_rounds_into_a_float16_cache():
    torch.manual_seed(0)
    heads, kv_heads, hd, n = 9, 3, 64, 23
    rotary = RotaryEmbedding(hd, 4096, 10000.0, None, torch.float32)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd) * 100
    cos_sin = rotary.lookup(torch.randint(0, 4096, (n,)))
    slots = torch.randperm(8 * 16)[:n]
    caches = [torch.zeros(8, 16, kv_heads, hd, dtype=torch.float16) for _ in range(2)]
    qk = kernels.rope_write_kv(qkv, *cos_sin, slots, *caches, heads, kv_heads)
    reference = rotary.apply(qkv[:, : (heads + kv_heads) * hd].reshape(n, heads + kv_heads, hd), cos_sin)
    torch.testing.assert_close(qk, reference, atol=0, rtol=0)
    for cache, x in zip(caches, (qk[:, heads:], qkv[:, (heads + kv_heads) * hd :].reshape(n, kv_heads, hd))):
        assert torch.equal(cache.view(-1, kv_heads, hd)[slots], x.half())  # rounded as .half() rounds


def quantized_cache(cache, full_k, full_v, cache_dtype):
    """A step's (key, value) cache as codes and scales (quantize_kv), and the per-sequence K and V
    the reference attends over: what the kernel reads, each token-head quantized and dequantized
    (float16: the cache rounded, and widened back)."""
    if cache_dtype == torch.float16:
        return tuple(c.half() for c in cache), *([x.half().float() for x in xs] for xs in (full_k, full_v))
    (key_codes, key_scales), (value_codes, value_scales) = (quantize_kv(c, cache_dtype) for c in cache)
    full_k, full_v = ([dequantize_kv(*quantize_kv(x, cache_dtype), torch.float32) for x in xs] for xs in (full_k, full_v))
    return (key_codes, value_codes, key_scales, value_scales), full_k, full_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 8), (9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("decode_lens,cache_dtype", [([700], None), ([65, 1000], None), ([300], torch.int8)])
def test_decode_kernel_splits_long_contexts_across_threads(dtype, heads, kv_heads, hd, decode_lens, cache_dtype):
    """Fewer (sequence, KV head) pairs than threads can share: on 2 threads the kernel cuts each
    context into parts (split-K), each part its own softmax maximum and sum, and combines them;
    the result agrees with the reference and with 1 thread (no split). bf16 with head sizes 64
    and 128 takes the AVX-512 BF16 path where built, head size 8 the generic one."""
    bs = 16
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(dtype, bs, kv_heads, heads, hd, decode_lens, [])
    if cache_dtype is not None:
        cache, full_k, full_v = quantized_cache(cache, full_k, full_v, cache_dtype)
    backend = TorchAttentionBackend(kernels=kernels)
    meta = backend.build_metadata(layout, "cpu")
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            outs[n] = backend.forward(query, key, value, tuple(t.clone() for t in cache), meta, 0.3)
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat([reference(q.float(), k.float(), v.float(), 0.3)
                          for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    tol = TOLERANCE[dtype]
    for out in outs.values():
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[2].float(), outs[1].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_quantizes_into_an_int8_cache_as_quantize_kv_does(dtype):
    torch.manual_seed(0)
    heads, kv_heads, hd, n = 9, 3, 64, 23
    rotary = RotaryEmbedding(hd, 4096, 10000.0, None, dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, dtype=dtype)
    qkv[3, (heads + kv_heads) * hd :] = 0  # an all-zero value vector: scale 0, codes 0
    cos_sin = rotary.lookup(torch.randint(0, 4096, (n,)))
    slots = torch.randperm(8 * 16)[:n]
    codes = [torch.zeros(8, 16, kv_heads, hd, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(8, 16, kv_heads) for _ in range(2)]
    qk = kernels.rope_write_kv(qkv, *cos_sin, slots, *codes, heads, kv_heads, *scales)
    reference = rotary.apply(qkv[:, : (heads + kv_heads) * hd].reshape(n, heads + kv_heads, hd), cos_sin)
    torch.testing.assert_close(qk, reference, atol=0, rtol=0)
    for stored_codes, stored_scales, x in zip(codes, scales, (qk[:, heads:], qkv[:, (heads + kv_heads) * hd :].reshape(n, kv_heads, hd))):
        expected_codes, expected_scales = quantize_kv(x, torch.int8)
        torch.testing.assert_close(stored_codes.view(-1, kv_heads, hd)[slots], expected_codes, atol=0, rtol=0)
        torch.testing.assert_close(stored_scales.view(-1, kv_heads)[slots], expected_scales, atol=0, rtol=0)
    assert scales[1].view(-1, kv_heads)[slots[3]].eq(0).all()


def random_int4(out_features: int, in_features: int, group_size: int, g: torch.Generator):
    """Random int4 codes and their record; and each weight's scale and min per input channel as
    the kernels see them (rounded to bf16)."""
    from tokenmill.layers.quantization.formats import pack_int4

    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    groups = in_features // group_size
    record = {"codes": pack_int4(codes), "scales": torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3,
              "mins": -torch.rand(out_features, groups, generator=g) * 0.1}
    scales, mins = (record[k].bfloat16().float().repeat_interleave(group_size, 1) for k in ("scales", "mins"))
    return codes, record, scales, mins


# The matmul kernels at every level this CPU executes (an AVX-512 machine checks the AVX2 code too;
# kernel_test_levels says which are left out).
MATMUL_LEVELS = kernel_test_levels()


@pytest.fixture(params=MATMUL_LEVELS)
def level(request):
    """The kernels module of one instruction-set level."""
    module = cpu_kernels.load(request.param)
    if module is None:
        pytest.skip(f"CPU kernels ({request.param}) not built here: {cpu_kernels.build_error(request.param)}")
    return module


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 as the AVX2 few-row kernels see it: int8 codes per block of 32 (round(x * 127
    / absmax)), times the block's scale absmax / 127."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (codes * (amax / 127)).view_as(x)


def activations(level, rows: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """x in the dtype the level computes in (bf16 with native bf16, fp32 below)."""
    x = torch.randn(rows, in_features, generator=g)
    return x.bfloat16() if level.native_bf16() else x


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 13, 64, 260])
@pytest.mark.parametrize("out_features,in_features,group_size", [(960, 576, 32), (48, 1536, 128), (32, 128, 64)])
def test_int4_linear_matches_the_dequantized_weight(level, rows, out_features, in_features, group_size):
    """Any number of rows, 4 at a time (6, 13: a last block of 2 and 1; 260: several panels of
    rows), one kernel that the layer takes for every row count, without a PyTorch copy of the
    codes."""
    from tokenmill.layers.linear import Int4Linear

    g = torch.Generator().manual_seed(rows)
    codes, record, scales, mins = random_int4(out_features, in_features, group_size, g)
    layer = Int4Linear(record, None, level)
    assert layer.kernel is level
    x = activations(level, rows, in_features, g)
    got = level.int4_linear(x, layer.kernel_codes, layer.kernel_pairs, group_size)
    assert got.dtype == x.dtype and got.shape == (rows, out_features)
    # every level: x in int8 per block of 32 against (q - 8) * scale, exact fp32 block sums against
    # min + 8 * scale (at avx512_bf16 rounded once to bf16 at the end)
    expected = int8_blocks(x) @ ((codes - 8) * scales).t() + x.float() @ (mins + 8 * scales).t()
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-8 if level.native_bf16() else 1e-4)
    assert torch.equal(layer(x), got)
    assert layer.packed.numel() == 0
    # within the int8 activations' error of the exact product
    torch.testing.assert_close(got.float(), x.float() @ (codes * scales + mins).t(), atol=6e-2, rtol=2e-2)


def test_int4_linear_keeps_its_int16_sums_exact_at_the_code_range_ends(level):
    """Every weight code 15 against x codes of +-127 (a block's absmax on every value): the
    largest int16 block sums the avx2 kernel keeps (8 x 2 x 15 x 127 = 30480) do not saturate."""
    from tokenmill.layers.linear import Int4Linear
    from tokenmill.layers.quantization.formats import pack_int4

    codes = torch.full((16, 128), 15)
    record = {"codes": pack_int4(codes), "scales": torch.full((16, 4), 0.5), "mins": torch.full((16, 4), -1.0)}
    layer = Int4Linear(record, None, level)
    x = torch.ones(2, 128)
    x[1] = -1
    got = layer(x.bfloat16() if level.native_bf16() else x).float()
    torch.testing.assert_close(got, x @ (codes * 0.5 - 1.0).t(), atol=1e-3, rtol=1e-5)  # +-832


def random_q4_k_record(out_features: int, in_features: int, g: torch.Generator):
    """Random int4 codes and the record a GGUF Q4_K tensor gives (models/gguf_blocks.py): its
    factors, and the scales and mins they make (exact in fp32), per input channel."""
    from tokenmill.layers.quantization.formats import pack_int4

    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    factors = torch.randint(0, 64, (out_features, in_features // 32, 2), generator=g).to(torch.uint8)
    supers = in_features // 256
    super_factors = torch.stack([torch.rand(out_features, supers, generator=g) * 1e-3 + 1e-4,
                                 -torch.rand(out_features, supers, generator=g) * 2e-3], dim=-1).half()
    scales, mins = (super_factors[..., i].float().repeat_interleave(8, 1) * factors[..., i] for i in (0, 1))
    record = {"codes": pack_int4(codes), "scales": scales, "mins": mins, "factors": factors,
              "super_factors": super_factors}
    return codes, record, scales.repeat_interleave(32, 1), mins.repeat_interleave(32, 1)


def q6_k_record(codes: torch.Tensor, g: torch.Generator) -> dict:
    """A Q6_K record (gguf_blocks.int6_record) over int6 codes [N, K] (K a multiple of 256):
    random int8 factors per 16 (negative ones too) and fp16 d per 256, and the scales d sc they
    make, exact in fp32."""
    n, k = codes.shape
    factors = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    super_factors = (torch.rand(n, k // 256, generator=g) * 1e-4 + 1e-5).half()
    return {"codes": codes, "scales": super_factors.float().repeat_interleave(16, 1) * factors, "factors": factors,
            "super_factors": super_factors}


@pytest.mark.parametrize("rows", [1, 3, 6, 64])
def test_int4_linear_reads_a_q4_k_records_own_factors(level, rows):
    """A Q4_K record runs on its factors (scale d sc, min m mn) in place of bf16 scales and mins:
    the products of the exact fp32 scales, where the bf16 pairs' are off by their rounding. At
    width 8 (avx2 to avx512_vnni) the factors in 6 bits (the file's 4.5 bits a weight); at
    avx512_bf16 (tiles of 16) a byte each (4.625 bits). x fp32 here, so y is not rounded to bf16."""
    from tokenmill.layers.linear import Int4Linear

    g = torch.Generator().manual_seed(rows)
    codes, record, scales, mins = random_q4_k_record(48, 768, g)
    layer = Int4Linear(record, None, level)
    pairs = Int4Linear({k: record[k] for k in ("codes", "scales", "mins")}, None, level)
    x = torch.randn(rows, 768, generator=g)
    got = level.int4_linear(x, layer.kernel_codes, layer.kernel_pairs, 32)
    assert torch.equal(layer(x), got)
    assert layer.kernel_pairs.dtype == torch.uint8
    # bits a weight beside its 4-bit code (the bf16 pairs: 1)
    bits = 0.625 if level.native_bf16() else 0.5
    assert layer.kernel_pairs.shape == ((3, 3, 320) if level.native_bf16() else (6, 3, 128))
    assert layer.kernel_pairs.numel() * 8 / (48 * 768) == bits and pairs.kernel_pairs.numel() * 16 / (48 * 768) == 1
    expected = (int8_blocks(x).double() @ ((codes - 8) * scales).double().t()
                + x.double() @ (mins + 8 * scales).double().t())
    exact_error = (got.double() - expected).abs().max().item()
    rounded_error = (pairs(x).double() - expected).abs().max().item()
    assert exact_error < 1e-5 * expected.abs().max().item() and exact_error < rounded_error / 10, (exact_error, rounded_error)
    wrong = Int4Linear(record | {"factors": record["factors"].roll(1, dims=0)}, None, level)
    assert not torch.allclose(wrong(x).double(), expected, rtol=0.01, atol=0.01 * expected.abs().max().item())


def test_int4_factors_beyond_6_bits_keep_the_bf16_pairs(level):
    """The avx2 super-block table holds 6-bit factors: a record with a wider one (not from a Q4_K
    file) runs on bf16 pairs there, with the same results as without its factors. The
    avx512_bf16 table holds a byte a factor, and takes it."""
    from tokenmill.layers.linear import Int4Linear

    g = torch.Generator().manual_seed(0)
    codes, record, scales, mins = random_q4_k_record(16, 256, g)
    record["factors"][3, 5, 1] = 64
    record["mins"][3, 5] = record["super_factors"][3, 0, 1].float() * 64
    layer = Int4Linear(record, None, level)
    pairs = Int4Linear({k: record[k] for k in ("codes", "scales", "mins")}, None, level)
    x = torch.randn(2, 256, generator=g)
    if level.native_bf16():
        assert layer.kernel_pairs.dtype == torch.uint8
        mins = record["mins"].repeat_interleave(32, 1)
        expected = (int8_blocks(x).double() @ ((codes - 8) * scales).double().t()
                    + x.double() @ (mins + 8 * scales).double().t())
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-6)
        return
    assert layer.kernel_pairs.dtype == torch.bfloat16
    assert torch.equal(layer(x), pairs(x))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 13, 64, 260])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (48, 1536), (8, 32)])
def test_int6_linear_matches_the_dequantized_weight(level, rows, out_features, in_features):
    """The 6-bit kernel (every level from avx2 up: the avx2 kernel, x in int8 per block of 32)
    at any number of rows against x's int8 blocks times (q - 32) * scale, negative scales too
    (Q6_K's), codes over the whole range 0..63."""
    from tokenmill.layers.linear import Int6Linear

    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 64, (out_features, in_features), generator=g).to(torch.uint8)
    scales = torch.rand(out_features, in_features // 16, generator=g) * 0.005 - 0.00125
    layer = Int6Linear({"codes": codes, "scales": scales}, None, level)
    assert layer.kernel is level and layer.weight is None
    weight = (codes.float() - 32).view(out_features, -1, 16) * scales[..., None]
    weight = weight.view(out_features, in_features)
    x = activations(level, rows, in_features, g)
    got = level.int6_linear(x, layer.low, layer.high, layer.tile_scales)
    assert got.dtype == x.dtype and got.shape == (rows, out_features)
    # the scales as the kernel reads them (bf16), x as int8 per block of 32
    bf16_weight = ((codes.float() - 32).view(out_features, -1, 16) * scales.bfloat16().float()[..., None]).view_as(weight)
    torch.testing.assert_close(got.float(), int8_blocks(x.float()) @ bf16_weight.t(), atol=1e-2, rtol=2**-7)
    # the layer: int6_linear, or above its max_rows (avx512_bf16) int6_gemm on the same tiles
    many = 0 < layer.max_rows < rows
    assert layer.max_rows == (INT6_GEMM_MIN_ROWS - 1 if level.native_bf16() else 0)
    kernel = level.int6_gemm if many else level.int6_linear
    assert torch.equal(layer(x), kernel(x, layer.low, layer.high, layer.tile_scales))
    torch.testing.assert_close(got.float(), x.float() @ weight.t(), atol=6e-2, rtol=2e-2)


@pytest.mark.skipif(kernels is None or not kernels.native_bf16(), reason="int6_gemm needs AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 8, 37, 260])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (40, 1536), (8, 32)])
def test_int6_gemm_matches_the_weight_widened_to_bf16(rows, out_features, in_features, with_bias):
    """int6_gemm (Int6Linear's many rows at avx512_bf16) on the int6 tiles: every weight scale x
    (q - 32) rounded once to bf16, bf16 x in exact products summed in fp32, rounded once; with the
    bf16 scales and with a Q6_K record's own factors, partial panels of 32 channels too."""
    from tokenmill.layers.linear import Int6Linear

    g = torch.Generator().manual_seed(rows + out_features)
    codes = torch.randint(0, 64, (out_features, in_features), generator=g).to(torch.uint8)
    scales = torch.rand(out_features, in_features // 16, generator=g) * 0.005 - 0.00125
    records = [{"codes": codes, "scales": scales}]
    if in_features % 256 == 0:
        records.append(q6_k_record(codes, g))
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g) if with_bias else None
    for record in records:
        layer = Int6Linear(record, None, kernels)
        table_scales = record["scales"] if "factors" in record else record["scales"].bfloat16().float()
        weight = ((codes.float() - 32).view(out_features, -1, 16) * table_scales[..., None]).view(out_features, -1)
        expected = x.float() @ weight.bfloat16().float().t() + (0 if bias is None else bias)
        got = kernels.int6_gemm(x, layer.low, layer.high, layer.tile_scales, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2**-8)
    with pytest.raises(RuntimeError, match="low"):
        kernels.int6_gemm(x[:, :16].contiguous(), layer.low, layer.high, layer.tile_scales)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int6_linear_reads_a_q6_k_records_own_factors(level, rows):
    """A Q6_K record (gguf_blocks.int6_record) runs on its factors (d per 256, int8 sc per 16,
    negative ones too: 6.5625 bits a weight) in place of bf16 scales: the products of the exact
    fp32 scales, where the bf16 scales' are off by their rounding."""
    from tokenmill.layers.linear import Int6Linear

    g = torch.Generator().manual_seed(rows)
    out_features, in_features = 40, 512
    codes = torch.randint(0, 64, (out_features, in_features), generator=g).to(torch.uint8)
    record = q6_k_record(codes, g)
    scales = record["scales"]
    layer = Int6Linear(record, None, level)
    plain = Int6Linear({"codes": codes, "scales": scales}, None, level)
    assert layer.tile_scales.dtype == torch.uint8 and layer.tile_scales.shape == (5, 2, 144)
    assert layer.tile_scales.numel() * 8 / (out_features * in_features) == 0.5625  # bits beside the 6 of a code
    x = torch.randn(rows, in_features, generator=g)  # fp32 at every level: no bf16 rounding of y
    got = level.int6_linear(x, layer.low, layer.high, layer.tile_scales)
    weight = (codes.double() - 32) * scales.double().repeat_interleave(16, 1)
    expected = int8_blocks(x.float()).double() @ weight.t()
    exact_error = (got.double() - expected).abs().max().item()
    rounded_error = (level.int6_linear(x, plain.low, plain.high, plain.tile_scales).double() - expected).abs().max().item()
    assert exact_error < 1e-5 * expected.abs().max().item() and exact_error < rounded_error / 10, (exact_error, rounded_error)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("factors", ["bf16", "q6_k"])
def test_int6_linear_is_the_same_at_every_level(rows, factors):
    """Each level's int6 kernel (avx512_bf16: one tile and a group of two steps a 512-bit register
    for one row, tile pairs from two) does the avx2 level's integer sums and fp32 operations per
    channel: the same y, bit for bit, for the bf16 scales and a Q6_K record's factors."""
    from tokenmill.layers.linear import Int6Linear

    levels = [cpu_kernels.load(isa) for isa in kernel_test_levels()]
    if len(levels) < 2:
        pytest.skip("one kernel level here")
    g = torch.Generator().manual_seed(rows)
    out_features, in_features = 48, 768
    codes = torch.randint(0, 64, (out_features, in_features), generator=g).to(torch.uint8)
    codes[0, :32], codes[1, :32] = 0, 63  # the code range's ends
    scales = torch.rand(out_features, in_features // 16, generator=g) * 0.02
    record = q6_k_record(codes, g) if factors == "q6_k" else {"codes": codes, "scales": scales}
    layer = Int6Linear(record, None, levels[0])
    x = torch.randn(rows, in_features, generator=g)  # fp32 at every level
    first = levels[0].int6_linear(x, layer.low, layer.high, layer.tile_scales)
    for other in levels[1:]:
        assert torch.equal(other.int6_linear(x, layer.low, layer.high, layer.tile_scales), first)


def test_int6_linear_keeps_its_int16_sums_exact_at_the_code_range_ends(level):
    """Codes 63 and 0 against x codes of +-127: a step's int16 sum of two vpmaddubsw (up to 4 x 63
    x 127 = 32004) does not saturate."""
    from tokenmill.layers.linear import Int6Linear

    for code in (63, 0):
        codes = torch.full((8, 64), code, dtype=torch.uint8)
        layer = Int6Linear({"codes": codes, "scales": torch.full((8, 4), 0.25)}, None, level)
        x = torch.ones(2, 64)
        x[1] = -1
        got = layer(x.bfloat16() if level.native_bf16() else x).float()
        torch.testing.assert_close(got, x @ torch.full((8, 64), (code - 32) * 0.25).t(), atol=1e-2, rtol=1e-5)


@pytest.mark.skipif(kernels is None or not kernels.native_bf16(), reason="bf16_linear needs AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("out_features,in_features,with_bias", [(960, 576, False), (37, 96, True)])
def test_bf16_linear_matches_an_fp32_matmul(rows, out_features, in_features, with_bias):
    from tokenmill.layers.linear import KERNEL_MAX_ROWS, DenseLinear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    expected = x.float() @ w.float().t() + (bias.float() if with_bias else 0)
    got = kernels.bf16_linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2**-8)  # fp32 sums, one rounding
    layer = DenseLinear(w, bias, kernels)
    assert layer.kernel is kernels and layer.plain is w
    if rows <= KERNEL_MAX_ROWS:
        assert torch.equal(layer(x), got)
    torch.testing.assert_close(DenseLinear(w, bias)(x).float(), expected, atol=2e-2, rtol=2e-2)  # oneDNN's


@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_int8_linear_matches_the_dequantized_weight(level, rows):
    from tokenmill.layers.linear import Int8Linear, kernel_rows
    from tokenmill.layers.quantization.formats import quantize_int8

    if level.native_bf16() and rows > 4:
        pytest.skip("the avx512_bf16 few-row kernel takes 1-4 rows")
    g = torch.Generator().manual_seed(rows)
    codes, scales = quantize_int8(torch.randn(200, 576, generator=g))
    codes[0, :40] = -128  # the code range's end (|code| 128 as vpmaddubsw's unsigned operand)
    x = activations(level, rows, 576, g)
    layer = Int8Linear({"codes": codes, "scales": scales}, None, kernels=level)
    assert layer.kernel is level
    exact = (x.float() @ codes.float().t()) * layer.scales.float()
    got = level.int8_linear(x, codes, layer.scales)
    assert got.dtype == x.dtype and got.shape == (rows, 200)
    if level.native_bf16():
        torch.testing.assert_close(got.float(), exact, atol=1e-3, rtol=2**-8)
    else:
        expected = (int8_blocks(x) @ codes.float().t()) * layer.scales.float()
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-4)
        torch.testing.assert_close(got, exact, atol=1.0, rtol=0)  # int8 activations: error std ~0.2, |y| ~ 25
    if rows <= kernel_rows(level)[0] and layer.tiles is None:
        assert torch.equal(layer(x), got)
    torch.testing.assert_close(Int8Linear({"codes": codes, "scales": scales}, None)(x).float(), exact,
                               atol=0.3, rtol=2e-2)  # PyTorch's _weight_int8pack_mm (bf16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 24, 25, 64, 260])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (48, 1536), (32, 132)])
def test_int8_tiled_linear_matches_the_dequantized_weight(level, rows, out_features, in_features):
    """avx512_bf16: tiles of 16 output channels at every row count (one tile at a time with 1-24
    rows, 4 rows a pass and a remainder; widened once into a buffer from 25); K a multiple of 4
    but not of 8 (132); exact products, fp32 sums, one rounding. avx2: tiles of 8, x in int8 per
    block of 32 (K a multiple of 32: 132 refused). Int8Linear keeps only the tiles where they fit
    and runs them at every row count."""
    from tokenmill.layers.linear import Int8Linear
    from tokenmill.layers.quantization.cpu_layouts import tiled_int8_layout
    from tokenmill.layers.quantization.formats import quantize_int8

    g = torch.Generator().manual_seed(rows)
    codes, scales = quantize_int8(torch.randn(out_features, in_features, generator=g))
    codes[0, :16] = -128  # the code range's end (exact in bf16; |code| 128 as vpmaddubsw's unsigned operand)
    x = activations(level, rows, in_features, g)
    bf16_scales = scales.to(torch.bfloat16)
    width = 16 if level.native_bf16() else 8
    tiles = tiled_int8_layout(codes, width)
    if not level.native_bf16() and in_features % 32:
        with pytest.raises(RuntimeError, match="multiple of 32"):
            level.int8_tiled_linear(x, tiles, bf16_scales)
        assert Int8Linear({"codes": codes, "scales": scales}, None, kernels=level).tiles is None
        return
    got = level.int8_tiled_linear(x, tiles, bf16_scales)
    assert got.dtype == x.dtype and got.shape == (rows, out_features)
    expected = (x.float() @ codes.float().t()) * bf16_scales.float()
    if level.native_bf16():
        torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2**-8)
    else:
        blocks = (int8_blocks(x) @ codes.float().t()) * bf16_scales.float()
        # (an x code can round the other way at a tie: one code step x one weight)
        torch.testing.assert_close(got, blocks, atol=5e-2, rtol=1e-3)
        torch.testing.assert_close(got, expected, atol=1.0, rtol=0)  # int8 activations: error std ~0.2
    if in_features % 16 == 0:
        layer = Int8Linear({"codes": codes, "scales": scales}, None, kernels=level)
        assert layer.codes is None and layer.tiles.shape == (out_features // width, in_features * width // 32, 32)
        assert torch.equal(layer(x), got)


@pytest.mark.parametrize("rows", [1, 7, 17, 64, 100, 260])
@pytest.mark.parametrize("out_features,in_features,with_bias", [(200, 576, False), (37, 48, True), (64, 1536, False)])
def test_int8_gemm_matches_the_dequantized_weight(level, rows, out_features, in_features, with_bias):
    """The many-row int8 kernel: row blocks of 8 and a remainder, a last panel of fewer than 32
    output channels (37, 200), K a multiple of 16 but not of 32 (48); avx512_bf16: exact
    products, fp32 sums, one rounding; avx2: fp32 panels (from 256 rows the whole weight widened
    once for at::mm). Int8Linear takes it above its max_rows where its tiles do not fit."""
    from tokenmill.layers.linear import Int8Linear
    from tokenmill.layers.quantization.formats import quantize_int8

    g = torch.Generator().manual_seed(rows)
    codes, scales = quantize_int8(torch.randn(out_features, in_features, generator=g))
    codes[0, :16] = -128  # the code range's end, exact in bf16 too
    x = activations(level, rows, in_features, g)
    bias = torch.randn(out_features, generator=g).to(x.dtype) if with_bias else None
    layer = Int8Linear({"codes": codes, "scales": scales}, None, kernels=level)
    expected = (x.float() @ codes.float().t()) * layer.scales.float() + (bias.float() if with_bias else 0)
    got = level.int8_gemm(x, codes, layer.scales, bias)
    assert got.dtype == x.dtype and got.shape == (rows, out_features)
    # exact products (bf16) or fp32 weights code * scale (fp32), fp32 sums, one rounding
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2**-8 if level.native_bf16() else 1e-5)
    if rows > layer.max_rows and layer.tiles is None:  # (where the tiles fit, Int8Linear runs int8_tiled_linear)
        assert torch.equal(layer(x), level.int8_gemm(x, codes, layer.scales))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        level.int8_gemm(x[:, :8].contiguous(), codes[:, :8].contiguous(), layer.scales)


def test_vnni_adds_the_same_integer_sums_as_vpmaddubsw():
    """avx512_vnni multiplies bytes with vpdpbusd in the int8 and int6 kernels, avx2 with
    vpmaddubsw + vpmaddwd: the same products and sums, and the same FP epilogue, so int8, int6
    and int4 (bf16 pairs and Q4_K factors; vpmaddubsw at both) give the same bits at both levels,
    at few rows and many, codes at the ends of their ranges included: an AVX2 host and an
    Ice Lake one serve the same outputs."""
    from tokenmill.layers.linear import Int4Linear, Int6Linear, Int8Linear
    from tokenmill.layers.quantization.formats import quantize_int8

    if not {"avx2", "avx512_vnni"} <= set(MATMUL_LEVELS):
        pytest.skip(f"needs the avx2 and avx512_vnni levels (this host runs {MATMUL_LEVELS})")
    plain, vnni = (cpu_kernels.load(isa) for isa in ("avx2", "avx512_vnni"))
    assert (plain.integer_dot(), vnni.integer_dot()) == ("vpmaddubsw", "vpdpbusd")
    g = torch.Generator().manual_seed(0)
    int4 = random_int4(64, 768, 32, g)[1]
    int4["codes"][:4] = 0xFF  # every code 15
    q4_k = random_q4_k_record(64, 768, g)[1]
    codes6 = torch.randint(0, 64, (64, 768), generator=g).to(torch.uint8)
    codes6[:4] = 63
    int6 = {"codes": codes6, "scales": torch.rand(64, 48, generator=g) * 0.005 - 0.00125}
    codes8, scales8 = quantize_int8(torch.randn(64, 768, generator=g))
    codes8[:4] = -128
    int8 = {"codes": codes8, "scales": scales8}
    for rows in (1, 3, 4, 37, 260):
        x = torch.randn(rows, 768, generator=g)
        x[0, :32] = 127.0  # a block of x codes all 127
        for cls, record in ((Int4Linear, int4), (Int4Linear, q4_k), (Int6Linear, int6), (Int8Linear, int8)):
            assert torch.equal(cls(record, None, kernels=plain)(x), cls(record, None, kernels=vnni)(x)), (cls.__name__, rows)
        assert torch.equal(plain.int8_linear(x[:4], codes8, scales8.bfloat16()),
                           vnni.int8_linear(x[:4], codes8, scales8.bfloat16()))


def test_512_bit_tiles_of_16_add_what_the_tiles_of_8_add():
    """avx512_bf16 runs int4 over tiles of 16 output channels and int6 over pairs of its tiles of
    8 with vpdpbusd on 512 bits, avx2 over tiles of 8 with vpmaddubsw: the same int8 codes of x,
    integer sums and FP epilogue per channel, so fp32 x gives the same bits at both levels (bf16
    scales and GGUF factors, codes at the ends of their ranges, few rows and many): a Zen 4 host
    and an AVX2 one serve the same outputs from a Q4_K_M file."""
    from tokenmill.layers.linear import Int4Linear, Int6Linear

    if not {"avx2", "avx512_bf16"} <= set(MATMUL_LEVELS):
        pytest.skip(f"needs the avx2 and avx512_bf16 levels (this host runs {MATMUL_LEVELS})")
    plain, wide = (cpu_kernels.load(isa) for isa in ("avx2", "avx512_bf16"))
    g = torch.Generator().manual_seed(0)
    int4 = random_int4(64, 768, 32, g)[1]
    int4["codes"][:4] = 0xFF  # every code 15
    grouped = random_int4(48, 1536, 128, g)[1]
    q4_k = random_q4_k_record(64, 768, g)[1]
    codes6 = torch.randint(0, 64, (48, 768), generator=g).to(torch.uint8)
    codes6[:4] = 63
    int6 = {"codes": codes6, "scales": torch.rand(48, 48, generator=g) * 0.005 - 0.00125}
    odd6 = {"codes": codes6[:40].contiguous(), "scales": int6["scales"][:40].contiguous()}  # 5 tiles: the last alone
    q6_k = q6_k_record(codes6[:32, :512].contiguous(), g)
    layers = [(Int4Linear, int4), (Int4Linear, grouped), (Int4Linear, q4_k), (Int6Linear, int6), (Int6Linear, odd6),
              (Int6Linear, q6_k)]
    for rows in (1, 2, 3, 5, 8, 9, 37, 260):
        x = torch.randn(rows, 1536, generator=g)
        x[0, :32] = 127.0  # a block of x codes all 127
        for cls, record in layers:
            a, b = cls(record, None, kernels=plain), cls(record, None, kernels=wide)
            xr = x[:, : a.in_features].contiguous()
            if cls is Int6Linear:  # int6_linear at every row count (at avx512_bf16 int6_gemm above max_rows)
                assert torch.equal(plain.int6_linear(xr, a.low, a.high, a.tile_scales),
                                   wide.int6_linear(xr, b.low, b.high, b.tile_scales)), (cls.__name__, rows)
                # bf16 x is taken as it is and y written in bf16: the fp32 results, rounded once
                xb = xr.bfloat16()
                assert torch.equal(wide.int6_linear(xb, b.low, b.high, b.tile_scales),
                                   wide.int6_linear(xb.float(), b.low, b.high, b.tile_scales).bfloat16())
            else:
                assert torch.equal(a(xr), b(xr)), (cls.__name__, rows)
                assert torch.equal(b(xr.bfloat16()), b(xr.bfloat16().float()).bfloat16())


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 1, 128), (12, 2, 64)])
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_fp32_decode_attention_at_every_level(level, heads, kv_heads, hd, cache_dtype):
    """fp32 decode attention (AVX2 + FMA at every level from avx2 up: 8 tokens' scores reduced
    together, query-head x head-dim register tiles over V; an int8 cache's codes widened exactly,
    its scales on each token's score and weight) against the reference, for GQA groups of 3, 8
    and 6, contexts not a multiple of 8, on 1 and 2 threads (split-K)."""
    decode_lens = [1, 7, 9, 40, 203]
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(torch.float32, 16, kv_heads, heads, hd,
                                                                          decode_lens, [])
    if cache_dtype is not None:
        cache, full_k, full_v = quantized_cache(cache, full_k, full_v, cache_dtype)
    backend = TorchAttentionBackend(kernels=level)
    meta = backend.build_metadata(layout, "cpu")
    expected = torch.cat([reference(q, k, v, 0.3) for q, k, v in zip(query.split(q_lens), full_k, full_v)])
    threads = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            out = backend.forward(query, key, value, tuple(t.clone() for t in cache), meta, 0.3)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


# Fresh prompts whose lengths are not multiples of the 64-key block or the 6-row tile (and of one
# token), and chunks of such lengths after earlier context, next to two decodes.
FP32_PREFILL = [(200, 200), (65, 65), (63, 63), (7, 7), (1, 1), (65, 130), (7, 71), (1, 200), (63, 300)]


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("cache_dtype", [None, torch.float16, torch.int8])
def test_fp32_prefill_kernel_at_every_level(level, heads, kv_heads, hd, cache_dtype):
    """Every fp32 prefill chunk of a step in one paged_prefill_attention call (AVX2 + FMA at every
    level from avx2 up) against a float64 reference: within 1e-5 absolute + 1e-5 relative (exact
    fp32 products, softmax and P V; measured max |error| ~1.2e-6). Through the backend a fresh
    prompt attends to its own K/V rows (full precision over an int8 or float16 cache), a chunk after
    context to the cache (int8: codes times scales, as dequantize_kv; float16 widened); called without key/value, fresh
    prompts read the cache too. Identical on 1 and 2 threads."""
    assert torch.float32 in level.prefill_attention_dtypes()
    cache, query, key, value, layout, full_k, full_v, q_lens = random_step(torch.float32, 16, kv_heads, heads, hd,
                                                                          [3, 40], FP32_PREFILL)
    if cache_dtype is not None:
        cache, lossy_k, lossy_v = quantized_cache(cache, full_k, full_v, cache_dtype)
    else:
        lossy_k, lossy_v = full_k, full_v
    backend = TorchAttentionBackend(kernels=level)
    meta = backend.build_metadata(layout, "cpu")
    assert prefill_kernel_takes(meta, torch.float32, hd, cache)
    scale = hd**-0.5
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            written = tuple(t.clone() for t in cache)
            outs[n] = backend.forward(query, key, value, written, meta, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1], outs[threads])
    seqs = list(zip(query.split(q_lens), full_k, full_v, lossy_k, lossy_v))
    expected = []
    for i, (q, k, v, lk, lv) in enumerate(seqs):
        own = i >= meta.num_decodes and q.shape[0] == k.shape[0]  # a fresh prompt: its own rows, else the cache
        expected.append(reference(q.double(), *(x.double() for x in ((k, v) if own else (lk, lv))), scale))
    torch.testing.assert_close(outs[1].double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    # the same chunks, every one reading the cache the step was written to
    n, (tables, seq_lens, query_lens) = meta.num_decodes, meta.prefill_kernel_args
    out = torch.empty_like(query[n:])
    level.paged_prefill_attention(out, query[n:], *written[:2], tables, seq_lens, query_lens, scale, *written[2:])
    expected = torch.cat([reference(q.double(), lk.double(), lv.double(), scale) for q, _, _, lk, lv in seqs[n:]])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_refuses_what_it_does_not_take(level):
    cache, query, key, value, layout, full_k, full_v, _ = random_step(torch.float32, 16, 3, 9, 64, [], [(10, 10)])
    args = TorchAttentionBackend(kernels=level).build_metadata(layout, "cpu").prefill_kernel_args
    out = torch.empty(query.shape)
    with pytest.raises(RuntimeError, match="takes fp32 queries"):
        level.paged_prefill_attention(out.half(), query.half(), *(c.half() for c in cache), *args, 0.125)
    if torch.bfloat16 not in level.prefill_attention_dtypes():
        with pytest.raises(RuntimeError, match="takes fp32 queries"):
            level.paged_prefill_attention(out.bfloat16(), query.bfloat16(), *(c.bfloat16() for c in cache), *args, 0.125)
    with pytest.raises(RuntimeError, match="compute dtype"):
        level.paged_prefill_attention(out, query, *(c.bfloat16() for c in cache), *args, 0.125)
    with pytest.raises(RuntimeError, match="query's dtype"):
        level.paged_prefill_attention(out.bfloat16(), query, *cache, *args, 0.125)
    with pytest.raises(RuntimeError, match="query's dtype"):
        level.paged_prefill_attention(out, query, *cache, *args, 0.125, key=key.bfloat16(), value=value.bfloat16())
    with pytest.raises(RuntimeError, match="sum to the number"):
        level.paged_prefill_attention(out[:9], query[:9], *cache, *args, 0.125)
    with pytest.raises(RuntimeError, match="query_len <= seq_len"):
        level.paged_prefill_attention(out, query, *cache, args[0], args[2] - 1, args[2], 0.125)
    with pytest.raises(RuntimeError, match="64 or 128"):
        level.paged_prefill_attention(out[..., :32].contiguous(), query[..., :32].contiguous(),
                                      *(c[..., :32].contiguous() for c in cache), *args, 0.125)
    with pytest.raises(RuntimeError, match="key and value: both or neither"):
        level.paged_prefill_attention(out, query, *cache, *args, 0.125, key=key)
    # a head size it does not take keeps PyTorch's SDPA for its prefills
    cache8, query8, key8, value8, layout8, full_k, full_v, _ = random_step(torch.float32, 16, 3, 9, 8, [], [(10, 10)])
    backend = TorchAttentionBackend(kernels=level)
    meta = backend.build_metadata(layout8, "cpu")
    assert not prefill_kernel_takes(meta, torch.float32, 8, cache8)
    out8 = backend.forward(query8, key8, value8, cache8, meta, 0.125)
    torch.testing.assert_close(out8, reference(query8, full_k[0], full_v[0], 0.125), atol=1e-5, rtol=1e-5)
