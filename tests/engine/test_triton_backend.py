"""The Triton attention backend inside the engine: greedy output token-identical to the PyTorch
backend (fp32) under in-flight batching with mixed lengths, chunked prefill, prefix-cache hits,
preemption and speculative verification. Without a GPU the kernels run in Triton's CPU
interpreter (tests/conftest.py), which is slow: small models and few tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import ConfigError, EngineConfig  # noqa: E402
from tokenmill.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402

pytestmark = pytest.mark.triton

SHARED = "You are a helpful assistant. Answer briefly and precisely, in plain words. "  # > 1 block: cached
PROMPTS = [SHARED + "What is 2 + 2?", "Hello", SHARED + "Name a color.", "The quick brown fox jumps over the lazy dog. " * 3]
MAX_TOKENS = [12, 20, 6, 9]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(n) for n in max_tokens])]


def test_auto_picks_torch_on_cpu_and_names_are_checked():
    assert EngineConfig(device="cpu").resolved_attention_backend("cpu") == "torch"
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_tiny_model_token_identical_to_torch_backend(tiny_qwen2_dir, speculative):
    """Small KV cache (preemption), 16-token step budget (chunked prefill), a shared prefix."""
    kw = dict(dtype="float32", num_kv_blocks=8, block_size=8, max_num_batched_tokens=16, swap_space_gb=0)
    if speculative:
        kw.update(speculative_method="ngram", speculative_ngram_min=1, speculative_max_running=8)
    torch_llm = LLM(str(tiny_qwen2_dir), attention_backend="torch", **kw)
    triton_llm = LLM(str(tiny_qwen2_dir), attention_backend="triton", **kw)
    assert triton_llm.engine.core.runner.attention_backend == "triton"
    expected = generate(torch_llm)
    assert generate(triton_llm) == expected
    # Again: the shared prefix now comes from the prefix cache.
    assert generate(triton_llm, PROMPTS[:1], MAX_TOKENS[:1]) == expected[:1]
    scheduler = triton_llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0 and triton_llm.engine.core.kv_cache_manager.prefix_hit_tokens > 0
    if speculative:
        assert scheduler.num_spec_accepted_tokens > 0


def test_padded_static_buffer_decode_steps_are_token_identical(tiny_qwen2_dir):
    """What a CUDA graph replays, run eagerly on CPU: decode batches padded to the bucket sizes
    1, 2, 4 (padding rows: slot -1, length 0) from static buffers, tables max_model_len wide."""
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    kw = dict(dtype="float32", num_kv_blocks=40, block_size=8, max_model_len=128, enforce_eager=True)
    expected = generate(LLM(str(tiny_qwen2_dir), attention_backend="torch", **kw), PROMPTS[:3], MAX_TOKENS[:3])
    llm = LLM(str(tiny_qwen2_dir), attention_backend="triton", **kw)
    runner = llm.engine.core.runner
    assert runner.decode_graphs is None  # enforce_eager (and on a CPU nothing is captured anyway)
    runner.decode_graphs = graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 8, 128, runner.device, capture=False)
    calls = []
    run = graphs.run
    graphs.run = lambda ids, *a: calls.append(len(ids)) or run(ids, *a)
    assert generate(llm, PROMPTS[:3], MAX_TOKENS[:3]) == expected
    assert 3 in calls and 1 in calls  # three requests padded to 4, then the longest alone


@pytest.mark.slow
def test_default_model_token_identical_to_torch_backend(default_model_path):
    prompts, max_tokens = ["The capital of France is", "def fib(n):"], [6, 4]
    kw = dict(dtype="float32", quantization="none", kv_cache_memory_gb=0.05)
    expected = generate(LLM(str(default_model_path), attention_backend="torch", **kw), prompts, max_tokens)
    assert generate(LLM(str(default_model_path), attention_backend="triton", **kw), prompts, max_tokens) == expected



@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_sliding_window_soft_capped_model_token_identical_to_torch_backend(family, default_checkpoint, tmp_path,
                                                                           monkeypatch):
    """Tiny random models of tests/models/test_families.py, window 8: Gemma 2 (sliding and full
    layers in turn, soft-capped scores and logits) and Mistral (every layer slides, so the blocks
    behind a window are freed on the way). Prompts of 20 and 45 tokens in 16-token steps cross
    the window in chunked prefill and in decode. Greedy tokens identical and every sampled row's
    logits within 1e-5 (Gemma 2's logits, capped at 0.4, hide a decode without the score cap
    from the tokens, not from the logits: up to 2e-4 apart)."""
    import torch

    from tests.models.test_families import FAMILIES, WINDOW, LastLogits, make_checkpoint

    make_checkpoint(tmp_path, FAMILIES[family](), default_checkpoint.tokenizer)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(default_checkpoint.tokenizer), (n,), generator=gen).tolist() for n in (3, 20, 45)]
    assert WINDOW < 20
    kw = dict(dtype="float32", block_size=8, max_num_batched_tokens=16, kv_cache_memory_gb=0.05)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), attention_backend=backend, **kw)
        assert llm.engine.core.runner.attention_backend == backend
        spy = LastLogits(llm.engine.core.runner.sampler)
        monkeypatch.setattr(llm.engine.core.runner, "sampler", spy)
        runs[backend] = generate(llm, prompts, [8, 8, 8]), dict(spy.seen)
    (expected, expected_logits), (tokens, logits) = runs["torch"], runs["triton"]
    assert tokens == expected
    assert logits.keys() == expected_logits.keys() and len(logits) == 3 * 8
    for context, row in logits.items():
        torch.testing.assert_close(row, expected_logits[context], atol=1e-5, rtol=0)
    freed = llm.engine.core.kv_cache_manager.num_window_freed_blocks
    assert (freed > 0) == (family == "mistral"), freed
