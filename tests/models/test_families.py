"""Every supported family against Hugging Face transformers (the independent oracle), on tiny
random-weight checkpoints made here from a transformers config with `save_pretrained`.

Each model has 3 layers, GQA, the default model's tokenizer, and every weight random (norms too,
so Gemma's (1 + w) is checked). Where a family slides a window, it is 8 tokens, so prompts of 20
and 45 tokens cross it in prefill chunks (16-token steps) and in decode, and where every layer
slides (Mistral, Phi-3) the blocks left behind are freed on the way; Gemma 2's soft-caps are
small enough to change every score and logit. fp32: the logits of every sampled position within
LOGITS_ATOL of transformers' (eager attention) on the same context, and greedy output
token-identical for 8 new tokens.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4  # fp32, tiny models (logits of magnitude ~1)
WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)


def _gemma3_config():
    return transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


# family -> (transformers config class, keyword arguments beyond COMMON) or a function making the config
FAMILIES = {
    "llama3.1-rope": lambda: transformers.LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-yarn": lambda: transformers.Qwen2Config(**COMMON, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    "phi3": lambda: transformers.Phi3Config(**COMMON, sliding_window=WINDOW, pad_token_id=0),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16,
                                                sliding_window=WINDOW, attn_logit_softcapping=0.5,
                                                final_logit_softcapping=0.4),
    "gemma3": _gemma3_config,
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                     norm_topk_prob=False),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=True),
}


class LastLogits:
    """Wraps the engine's sampler to record each sampled row's context and logits."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.seen: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def __call__(self, logits, rows, *args):
        for i, row in enumerate(rows):
            self.seen.append((tuple(row.prompt_token_ids) + tuple(row.output_token_ids), logits[i].cpu().clone()))
        return self.sampler(logits, rows, *args)


def make_checkpoint(directory, config, tokenizer) -> None:
    """A random-weight model of `config` saved with `tokenizer`: every parameter drawn, norms around 1."""
    config.vocab_size = len(tokenizer)
    config.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if "gemma" in config.model_type else param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(std=0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_and_greedy_match_hf(family, test_tokenizer, tmp_path, monkeypatch):
    make_checkpoint(tmp_path, FAMILIES[family](), test_tokenizer)
    device = EngineConfig().resolved_device()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").to(device).eval()
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.05)
    spy = LastLogits(llm.engine.core.runner.sampler)
    monkeypatch.setattr(llm.engine.core.runner, "sampler", spy)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(test_tokenizer), (n,), generator=gen).tolist() for n in (3, 20, 45)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    worst = 0.0
    with torch.inference_mode():
        for context, logits in spy.seen:
            ref = hf(torch.tensor([context], device=device)).logits[0, -1].float().cpu()
            worst = max(worst, float((logits - ref).abs().max()))
        for prompt, out in zip(prompts, outs):
            ref_tokens = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref_tokens
    assert len(spy.seen) == 3 * 8
    assert worst < LOGITS_ATOL, f"{family}: max |logit diff| {worst:.2e}"
    # where every layer slides, the blocks behind the window went back to the pool on the way
    freed = llm.engine.core.kv_cache_manager.num_window_freed_blocks
    assert (freed > 0) == llm.engine.core.runner.model.config.all_layers_slide, freed
