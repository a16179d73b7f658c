"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention, every MLP a mixture of experts (the
top-k of the router's softmax; renormalized in Qwen3-MoE, as they come in Qwen2-MoE). Qwen2-MoE
adds a shared expert that every token runs, scaled by a sigmoid gate. An expert's projections
are named as a dense MLP's: gate_proj, up_proj, down_proj.
"""

from __future__ import annotations

import torch

from tokenmill.models.llama import LlamaDecoderLayer, LlamaMLP
from tokenmill.models.loader.checkpoint import ModelLoadError
from tokenmill.models.moe import MoEForCausalLM, MoEMLP
from tokenmill.models.qwen2 import QWEN_HF_DEFAULTS, Qwen3DecoderLayer, qwen_sliding_window

QWEN_EXPERT_MODULES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def qwen_moe_hf_fields(hf) -> dict:
    """The experts' fields of a Qwen-MoE config.json; every layer's MLP must be experts."""
    raw = hf.raw
    if int(raw.get("decoder_sparse_step") or 1) != 1 or raw.get("mlp_only_layers"):
        raise ModelLoadError(f"{hf.source}: dense MLP layers between expert layers (decoder_sparse_step "
                             f"{raw.get('decoder_sparse_step')}, mlp_only_layers {raw.get('mlp_only_layers')}) "
                             "are not supported")
    experts = raw.get("num_experts") or raw.get("num_local_experts") or hf.get("num_experts")  # transformers 5 writes the latter
    return {"num_experts": int(experts), "num_experts_per_tok": int(hf.get("num_experts_per_tok")),
            "moe_intermediate_size": int(hf.get("moe_intermediate_size")),
            "shared_expert_intermediate_size": int(hf.optional("shared_expert_intermediate_size") or 0),
            "norm_topk_prob": bool(hf.optional("norm_topk_prob")), **qwen_sliding_window(hf)}


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
    hf_model_types = {"qwen2_moe": QWEN_HF_DEFAULTS | {"num_experts": 60, "num_experts_per_tok": 4,
                                                       "moe_intermediate_size": 1408,
                                                       "shared_expert_intermediate_size": 5632, "norm_topk_prob": False}}
    gguf_architectures = ("qwen2moe",)

    @classmethod
    def hf_fields(cls, hf):
        return {"attention_bias": True, **qwen_moe_hf_fields(hf)}  # Qwen2's q/k/v biases

    @classmethod
    def gguf_fields(cls, gguf):
        return super().gguf_fields(gguf) | {"norm_topk_prob": False}

    @classmethod
    def mlp_weight_shapes(cls, config, layer):
        """The experts', then the shared expert's and its gate's where the model has one."""
        shapes = super().mlp_weight_shapes(config, layer)
        if config.num_experts and (shared := config.shared_expert_intermediate_size):
            hidden, expert = config.hidden_size, f"{layer}.mlp.shared_expert"
            shapes |= {f"{expert}.gate_proj.weight": (shared, hidden), f"{expert}.up_proj.weight": (shared, hidden),
                       f"{expert}.down_proj.weight": (hidden, shared), f"{layer}.mlp.shared_expert_gate.weight": (1, hidden)}
        return shapes


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, reduce) -> MoEMLP:
        return MoEMLP(config)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    takes_cpu_decoder = False
    expert_modules = QWEN_EXPERT_MODULES
    hf_model_types = {"qwen3_moe": QWEN_HF_DEFAULTS | {"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                                                       "moe_intermediate_size": 768, "norm_topk_prob": False}}
    gguf_architectures = ("qwen3moe",)

    @classmethod
    def hf_fields(cls, hf):
        return {"qk_norm": True, **qwen_moe_hf_fields(hf)}  # Qwen3's q/k norms

    @classmethod
    def gguf_fields(cls, gguf):
        return super().gguf_fields(gguf) | {"qk_norm": True}
