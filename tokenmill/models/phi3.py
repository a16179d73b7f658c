"""Phi-3: Llama's layer, whose checkpoints hold q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, fused as the linears here are, so nothing is packed on load (each loads whole:
`CausalLM.whole_shard`). Every layer may slide a window. The compiled CPU decoder takes it.
"""

from __future__ import annotations

from tokenmill.models.llama import LLAMA_HF_DEFAULTS, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    takes_cpu_decoder = True
    packed_modules = {}  # the checkpoint's projections are already fused
    hf_model_types = {"phi3": LLAMA_HF_DEFAULTS | {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}}
    gguf_architectures = ("phi3",)
    gguf_rows_permuted_for_rope = False
    gguf_tensor_names = {"blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.gate_up_proj.weight"}  # gate and up

    @classmethod
    def gguf_fields(cls, gguf):
        window = gguf.get("attention.sliding_window", None)
        return {"sliding_window": int(window) if window else None}

    @classmethod
    def attention_weight_shapes(cls, config, layer):
        q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return {f"{layer}.self_attn.qkv_proj.weight": (q_size + 2 * kv_size, config.hidden_size)}

    @classmethod
    def mlp_weight_shapes(cls, config, layer):
        hidden, ffn = config.hidden_size, config.intermediate_size
        return {f"{layer}.mlp.gate_up_proj.weight": (2 * ffn, hidden), f"{layer}.mlp.down_proj.weight": (hidden, ffn)}
