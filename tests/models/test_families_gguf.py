"""GGUF files of the families llama.cpp stores differently, against Hugging Face transformers on
the same weights.

A tiny random model is made with transformers, then written as llama.cpp's converter writes it
(its tensor names, q/k rows permuted for Llama's RoPE, Gemma's norms stored as 1 + w, Llama 3.1's
frequency factors as a rope_freqs tensor, experts as one 3-D tensor per projection), with a
260-token byte-level vocabulary. tokenmill loads the GGUF; its fp32 logits must match
transformers' on the original model within LOGITS_ATOL and greedy output be token-identical.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import ModelLoadError, load_checkpoint

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4
VOCAB = 260
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=258, eos_token_id=259)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# Hugging Face name within a layer -> llama.cpp's
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def llama3_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's converter: per frequency, the divisor that turns the plain frequency into Llama 3's."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama: each head's two RoPE halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, model, extra_kv=None, permute_qk=False, norm_plus_one=False, rope_freqs=None,
               types=None):
    """`types`: llama.cpp's tensor name (within a layer: "attn_q.weight") -> the GGMLQuantizationType
    it is stored as (default F32)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = c.rope_parameters.get("rope_theta") if "rope_theta" in c.rope_parameters else \
        c.rope_parameters["full_attention"]["rope_theta"]
    writer.add_rope_freq_base(theta)
    for add in extra_kv or []:
        add(writer)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    names = GEMMA_LAYER_NAMES if arch.startswith("gemma") else LAYER_NAMES
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for hf_name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if c.tie_word_embeddings and hf_name == "lm_head.weight":
                continue
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[hf_name]
        else:
            layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
            if rest == "mlp.experts.gate_up_proj":  # transformers keeps every expert in one tensor
                gate, up = np.split(w, 2, axis=1)
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            if rest == "mlp.experts.down_proj":
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(w))
                continue
            gguf_name = f"blk.{layer}.{names[rest]}"
            if permute_qk and rest == "self_attn.q_proj.weight":
                w = permute(w, c.num_attention_heads)
            if permute_qk and rest == "self_attn.k_proj.weight":
                w = permute(w, c.num_key_value_heads)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        if norm_plus_one and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        qtype = (types or {}).get(gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name)
        if qtype is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if "gemma" in config.model_type else param.uniform_(0.5, 1.5)
    return model.eval()


def gemma3_model():
    config = transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention"] * 3,  # llama.cpp's pattern: every sixth layer is global
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return random_model(config)


CASES = {
    # Llama 3.1: the frequency factors as a tensor, q/k rows permuted
    "llama3.1": lambda path: _write(path, "llama", random_model(transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)),
                                    permute_qk=True, rope_freqs=llama3_rope_freqs(16, LLAMA3_ROPE)),
    "gemma3": lambda path: _write(path, "gemma3", gemma3_model(), norm_plus_one=True,
                                  extra_kv=[lambda w: w.add_sliding_window(8)]),
    "qwen3": lambda path: _write(path, "qwen3", random_model(transformers.Qwen3Config(**COMMON, head_dim=32))),
    # Mixtral: llama.cpp says "llama" with an expert count
    "mixtral": lambda path: _write(path, "llama", random_model(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2)), permute_qk=True,
        extra_kv=[lambda w: w.add_expert_count(4), lambda w: w.add_expert_used_count(2)]),
    # Qwen2-MoE: a shared expert and its gate (one row, stored 1-D by llama.cpp)
    "qwen2moe": lambda path: _write(path, "qwen2moe", random_model(transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False)),
        extra_kv=[lambda w: w.add_expert_count(4), lambda w: w.add_expert_used_count(2),
                  lambda w: w.add_expert_feed_forward_length(32), lambda w: w.add_expert_shared_feed_forward_length(48)]),
    "qwen3moe": lambda path: _write(path, "qwen3moe", random_model(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
        extra_kv=[lambda w: w.add_expert_count(4), lambda w: w.add_expert_used_count(2),
                  lambda w: w.add_expert_feed_forward_length(32)]),
}


def _write(path, arch, model, **kwargs):
    write_gguf(path, arch, model, **kwargs)
    return model


@pytest.mark.parametrize("case", CASES)
def test_gguf_family_matches_hf(case, tmp_path):
    path = tmp_path / f"{case}.gguf"
    hf = CASES[case](path)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.02)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=True)
    outs = llm.generate(prompts, params)
    worst = 0.0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            ours = [lp for lp in out.prompt_logprobs[1:]]
            for i, lp in enumerate(ours):
                worst = max(worst, abs(lp - float(ref[i, prompt[i + 1]])))
            ref_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref_tokens
    assert worst < LOGITS_ATOL, f"{case}: max |prompt logprob diff| {worst:.2e}"


def test_moe_gguf_without_expert_count_names_experts(tmp_path):
    """A GGUF whose expert tensors its metadata does not declare fails naming the experts."""
    path = tmp_path / "mixtral.gguf"
    write_gguf(path, "llama", random_model(transformers.MixtralConfig(**COMMON, num_local_experts=4)), permute_qk=True)
    with pytest.raises(ModelLoadError, match="mixture of experts"):
        load_checkpoint(path)
