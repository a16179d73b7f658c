"""A tiny random Qwen2-style model (q/k/v bias, untied LM head) saved as a Hugging Face
directory: tokenmill's logits and greedy tokens match transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_families import LastLogits
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig

LOGITS_ATOL = 1e-4  # fp32, tiny model (logits of magnitude ~1)


def test_tiny_qwen2_logits_and_greedy_match_hf(tiny_qwen2_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    device = EngineConfig().resolved_device()  # tokenmill's default device: HF runs there too
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).to(device).eval()
    assert hf.config.tie_word_embeddings is False
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.05)
    assert llm.engine.core.runner.model.config.attention_bias
    spy = LastLogits(llm.engine.core.runner.sampler)
    monkeypatch.setattr(llm.engine.core.runner, "sampler", spy)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 20, 45)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    worst = 0.0
    with torch.inference_mode():
        for context, logits in spy.seen:
            ref = hf(torch.tensor([context], device=device)).logits[0, -1].cpu()
            worst = max(worst, float((logits - ref).abs().max()))
        for prompt, out in zip(prompts, outs):
            ref_tokens = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                     pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref_tokens
    assert len(spy.seen) == 3 * 8
    assert worst < LOGITS_ATOL, f"max |logit diff| {worst:.2e}"
