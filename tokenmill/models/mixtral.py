"""Mixtral: Llama's attention, every MLP a mixture of experts (top-k of the router's softmax,
renormalized). Its checkpoints call the expert MLP `block_sparse_moe` and an expert's
projections w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from tokenmill.models.llama import LLAMA_HF_DEFAULTS, LlamaDecoderLayer
from tokenmill.models.moe import MoEForCausalLM, MoEMLP


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, reduce) -> MoEMLP:
        return MoEMLP(config)


class MixtralForCausalLM(MoEForCausalLM):
    layer_class = MixtralDecoderLayer
    takes_cpu_decoder = False
    expert_modules = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
    renamed_modules = {"block_sparse_moe": "mlp"}
    hf_model_types = {"mixtral": LLAMA_HF_DEFAULTS | {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                                                      "max_position_embeddings": 4096 * 32, "num_local_experts": 8,
                                                      "num_experts_per_tok": 2}}
    # llama.cpp writes Mixtral as "llama" with an expert count (and Llama's q/k row order)
    gguf_architectures = ("llama",)
    gguf_rows_permuted_for_rope = True
    gguf_tensor_names = {"blk.{bid}.ffn_gate_inp.weight": "model.layers.{bid}.block_sparse_moe.gate.weight"}

    @classmethod
    def hf_fields(cls, hf):
        return hf.sliding_window() | {
            "num_experts": int(hf.get("num_local_experts")), "num_experts_per_tok": int(hf.get("num_experts_per_tok")),
            "moe_intermediate_size": int(hf.get("intermediate_size")), "norm_topk_prob": True}
