"""Mixtral: Llama's attention, every MLP a mixture of experts (top-k of the router's softmax,
renormalized). Its checkpoints call the expert MLP `block_sparse_moe` and an expert's
projections w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from tokenmill.models.llama import LlamaDecoderLayer
from tokenmill.models.moe import MoEForCausalLM, MoEMLP


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, reduce) -> MoEMLP:
        return MoEMLP(config)


class MixtralForCausalLM(MoEForCausalLM):
    layer_class = MixtralDecoderLayer
    takes_cpu_decoder = False
    expert_modules = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
    renamed_modules = {"block_sparse_moe": "mlp"}
