"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention, every MLP a mixture of experts (the
top-k of the router's softmax; renormalized in Qwen3-MoE, as they come in Qwen2-MoE). Qwen2-MoE
adds a shared expert that every token runs, scaled by a sigmoid gate. An expert's projections
are named as a dense MLP's: gate_proj, up_proj, down_proj.
"""

from __future__ import annotations

import torch

from tokenmill.models.llama import LlamaDecoderLayer, LlamaMLP
from tokenmill.models.moe import MoEForCausalLM, MoEMLP
from tokenmill.models.qwen2 import Qwen3DecoderLayer

QWEN_EXPERT_MODULES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


class Qwen2MoeMLP(MoEMLP):
    """The routed experts plus, where the checkpoint has one, the shared expert behind its gate."""

    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, sparse: None = None) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, reduce) -> Qwen2MoeMLP:
        return Qwen2MoeMLP(config)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen2MoeDecoderLayer
    takes_cpu_decoder = False
    expert_modules = QWEN_EXPERT_MODULES


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, reduce) -> MoEMLP:
        return MoEMLP(config)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    takes_cpu_decoder = False
    expert_modules = QWEN_EXPERT_MODULES
