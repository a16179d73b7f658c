"""Parity with Hugging Face transformers on the default model (the independent oracle).

fp32: 8 prompts (5-300 tokens) submitted together, decoded as one in-flight batch with a
32-token step budget (so prompts are prefilled in chunks while others decode) must give
token-identical greedy output to HF for 64 new tokens each, and last-prompt-position logits
within FP32_LOGITS_ATOL of HF's. bf16: logits within BF16_LOGITS_ATOL, and the share of
identical greedy tokens is reported. Perplexity on GPL-3's first PPL_WINDOWS windows (chunked
prefill with prompt logprobs, all windows in one batch) within 0.5% of HF's.

Both engines run on the device tokenmill picks by default (a CUDA GPU when there is one, where
these tests are the GPU parity check); logits are compared on the CPU. Qwen2.5-Coder-1.5B, on
request: TOKENMILL_QWEN_GGUF=path/to/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf (see MODELS.md).
On a GPU machine without the model files, benchmarks/gpu_parity.py checks the same parity on
random-weight models of real shapes (scripts/gpu_run.sh).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.eval.perplexity import gpl3_token_ids, perplexity, perplexity_windows

pytestmark = pytest.mark.slow

GPL3 = Path("/usr/share/common-licenses/GPL-3")
PROMPT_LENGTHS = [5, 17, 33, 64, 100, 150, 230, 300]
NUM_NEW_TOKENS = 64
PPL_WINDOWS = 4  # of 512 tokens: every window is scored alike, a few compare the engines as well as 14
FP32_LOGITS_ATOL = 1e-3  # max |logit difference| over the whole vocab, fp32 (measured: ~4e-5)
BF16_LOGITS_ATOL = 1.5  # max |logit difference|, bf16 (logits ~20 have a bf16 spacing of 0.125)
BF16_ERROR_RATIO = 1.5
DEVICE = EngineConfig().resolved_device()  # where LLM(...) runs by default: the HF reference runs there too


@pytest.fixture(scope="module")
def hf_fp32(hf_model):
    """The session's HF fp32 model (tests/conftest.py), on DEVICE (a copy when that is not the CPU)."""
    pytest.importorskip("accelerate")
    return hf_model if DEVICE == "cpu" else copy.deepcopy(hf_model).to(DEVICE)


@pytest.fixture(scope="module")
def llm_fp32(default_model_path):
    return LLM(str(default_model_path), dtype="float32", quantization="none", max_num_batched_tokens=32, kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def prompts(llm_fp32) -> list[list[int]]:
    """Token-id prompts of the given lengths, each a different slice of English prose."""
    text_ids = llm_fp32.tokenizer.encode(GPL3.read_text())
    return [text_ids[1000 * i : 1000 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode with HF's own KV cache; returns new tokens and last-prompt-position logits."""
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    first_logits = out.logits[0, -1].float().cpu()
    tokens = [int(first_logits.argmax())]
    past = out.past_key_values
    for _ in range(num_new - 1):
        out = model(torch.tensor([[tokens[-1]]], device=model.device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, first_logits


@torch.inference_mode()
def hf_greedy_check(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy choice after the prompt and after each prefix of `tokens`, from one forward
    pass over prompt + tokens[:-1] (causal: each position sees only what precedes it), and the
    last-prompt-position logits. `tokens` is HF's greedy decode exactly when the two lists are
    equal, and where they first differ is where a greedy decode with HF would have parted from
    `tokens`: the check of hf_greedy without its one forward per new token."""
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 :].float().cpu()
    return logits.argmax(dim=-1).tolist(), logits[0]


class LogitsSpy:
    """Wraps the engine's sampler to record the logits each prompt's first token was sampled from."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.first_logits: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, logits, rows, *args):
        for i, row in enumerate(rows):
            if len(row.output_token_ids) == 0:
                self.first_logits[tuple(row.prompt_token_ids)] = logits[i].float().cpu().clone()
        return self.sampler(logits, rows, *args)


def run_tokenmill(llm: LLM, prompts, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = llm.engine.core.runner
    spy = LogitsSpy(runner.sampler)
    monkeypatch.setattr(runner, "sampler", spy)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], [spy.first_logits[tuple(p)] for p in prompts]


def test_fp32_greedy_is_token_identical_to_hf_in_one_inflight_batch(hf_fp32, llm_fp32, prompts, monkeypatch):
    ours, our_logits = run_tokenmill(llm_fp32, prompts, monkeypatch)
    worst = 0.0
    for prompt, tokens, logits in zip(prompts, ours, our_logits):
        assert len(tokens) == NUM_NEW_TOKENS
        ref_tokens, ref_logits = hf_greedy_check(hf_fp32, prompt, tokens)
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens diverges from HF"
        worst = max(worst, float((logits - ref_logits).abs().max()))
    print(f"\nfp32 max |logit - HF logit| over 8 prompts: {worst:.2e} (tolerance {FP32_LOGITS_ATOL})")
    assert worst < FP32_LOGITS_ATOL


def test_chunked_prefill_really_happened(llm_fp32, prompts):
    # With a 32-token budget every prompt over 32 tokens is computed in several steps.
    assert llm_fp32.engine.config.max_num_batched_tokens == 32
    assert max(len(p) for p in prompts) > 32 * 9


def test_bf16_logits_close_to_hf_bf16(hf_fp32, default_model_path, prompts, monkeypatch):
    """bf16 rounds every activation to 8 mantissa bits, so neither engine matches fp32 exactly.
    Ours must stay within BF16_LOGITS_ATOL of HF bf16, and its error against the fp32 reference
    must be of the same size as HF bf16's own (at most BF16_ERROR_RATIO times it)."""
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    llm = LLM(str(default_model_path), dtype="bfloat16", quantization="none", max_num_batched_tokens=32, kv_cache_memory_gb=0.25)
    # bf16 is emulated (slow) on CPUs without native bf16: half the prompts, fewer tokens.
    prompts, num_new = prompts[::2], 8
    runner = llm.engine.core.runner
    spy = LogitsSpy(runner.sampler)
    monkeypatch.setattr(runner, "sampler", spy)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True))
    same = prefix = 0
    vs_hf = ours_vs_fp32 = hf_vs_fp32 = 0.0
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logits = hf_greedy(hf_bf16, prompt, num_new)
        _, fp32_logits = hf_greedy(hf_fp32, prompt, 1)
        ours = spy.first_logits[tuple(prompt)]
        vs_hf = max(vs_hf, float((ours - ref_logits).abs().max()))
        ours_vs_fp32 = max(ours_vs_fp32, float((ours - fp32_logits).abs().max()))
        hf_vs_fp32 = max(hf_vs_fp32, float((ref_logits - fp32_logits).abs().max()))
        tokens = out.outputs[0].token_ids
        same += sum(a == b for a, b in zip(tokens, ref_tokens))
        prefix += next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), num_new)
    total = num_new * len(prompts)
    print(f"\nbf16 max |logit diff|: tokenmill vs HF bf16 {vs_hf:.3f} (tolerance {BF16_LOGITS_ATOL}); "
          f"vs HF fp32: tokenmill {ours_vs_fp32:.3f}, HF bf16 {hf_vs_fp32:.3f}. "
          f"Greedy tokens identical to HF bf16: {same}/{total} = {same / total:.1%} by position, "
          f"{prefix}/{total} = {prefix / total:.1%} before the first divergence")
    assert vs_hf < BF16_LOGITS_ATOL
    assert ours_vs_fp32 < BF16_ERROR_RATIO * hf_vs_fp32


@torch.inference_mode()
def hf_perplexity(model, token_ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for chunk in perplexity_windows(token_ids, window):
        logits = model(torch.tensor([chunk], device=model.device)).logits[0].float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        first = window // 2
        targets = torch.tensor(chunk[first + 1 :])
        nll -= float(logprobs[first:-1].gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def test_perplexity_on_gpl3_matches_hf(hf_fp32, llm_fp32):
    token_ids = gpl3_token_ids(llm_fp32.tokenizer, window=512, max_windows=PPL_WINDOWS, path=GPL3)
    assert len(perplexity_windows(token_ids, 512)) == PPL_WINDOWS
    ours = perplexity(llm_fp32, token_ids, window=512)
    ref = hf_perplexity(hf_fp32, token_ids, window=512)
    print(f"\nGPL-3 perplexity ({PPL_WINDOWS} 512-token windows, second half scored): tokenmill {ours:.4f}, HF {ref:.4f}")
    assert abs(ours - ref) / ref < 0.005


QWEN_GGUF = os.environ.get("TOKENMILL_QWEN_GGUF")
QWEN_FP32_LOGITS_ATOL = 1e-2  # logits ~30 over 1.5B parameters of fp32 sums (not yet measured on a GPU)


@pytest.mark.skipif(not QWEN_GGUF, reason="set TOKENMILL_QWEN_GGUF to Qwen2.5-Coder-1.5B-Instruct's GGUF")
def test_qwen25_coder_15b_fp32_greedy_is_token_identical_to_hf(monkeypatch):
    """The issue's second model (q/k/v biases, untied LM head, vocab 151,936): 4 prompts decoded
    together with chunked prefill, 32 greedy tokens each, identical to HF's; first logits close."""
    transformers = pytest.importorskip("transformers")
    path = Path(QWEN_GGUF)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf = hf.to(DEVICE).eval()
    llm = LLM(str(path), dtype="float32", quantization="none", max_num_batched_tokens=64, kv_cache_memory_gb=1)
    text_ids = llm.tokenizer.encode(GPL3.read_text())
    prompts = [text_ids[700 * i : 700 * i + n] for i, n in enumerate([6, 40, 150, 400])]
    runner = llm.engine.core.runner
    spy = LogitsSpy(runner.sampler)
    monkeypatch.setattr(runner, "sampler", spy)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 32)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverges from HF"
        worst = max(worst, float((spy.first_logits[tuple(prompt)] - ref_logits).abs().max()))
    print(f"\nQwen2.5-Coder-1.5B fp32 on {DEVICE}: max |logit - HF logit| {worst:.2e} (tolerance {QWEN_FP32_LOGITS_ATOL})")
    assert worst < QWEN_FP32_LOGITS_ATOL
