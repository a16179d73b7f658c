"""Qwen2 / Qwen2.5 and Qwen3.

Qwen2 is Llama's layer with q/k/v biases (ModelArchConfig.attention_bias, which the loaders set
for every Qwen2 checkpoint) whose upper layers may slide a window (`max_window_layers`): the
compiled CPU decoder takes it. Qwen3 normalizes each query and key head (an RMSNorm over
head_dim) before RoPE, which the compiled decoder does not do: its Python layers run every step.
"""

from __future__ import annotations

import torch

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.models.base import CausalLM
from tokenmill.models.llama import LLAMA_HF_DEFAULTS, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

QWEN_HF_DEFAULTS = LLAMA_HF_DEFAULTS | {"max_position_embeddings": 32768}


def qwen_sliding_window(hf, used_only_with: str | None = "use_sliding_window") -> dict:
    """sliding_window and layer_types of a Qwen config.json: the layers from max_window_layers up
    slide. Qwen configs carry a window they use only with use_sliding_window (Qwen3's: always)."""
    def layer_types() -> list[str]:
        first_sliding = hf.raw.get("max_window_layers", hf.num_layers)
        return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(hf.num_layers)]

    return hf.sliding_window(layer_types, used_only_with)


class Qwen2ForCausalLM(LlamaForCausalLM):
    takes_cpu_decoder = True
    hf_model_types = {"qwen2": QWEN_HF_DEFAULTS}
    gguf_architectures = ("qwen2",)
    gguf_rows_permuted_for_rope = False

    @classmethod
    def hf_fields(cls, hf):
        return {"attention_bias": True, **qwen_sliding_window(hf)}  # every Qwen2 has q/k/v biases


class Qwen3Attention(LlamaAttention):
    """Llama's attention with an RMSNorm over each query and key head before RoPE (Gemma 3's
    attention has them too: models/gemma.py)."""

    def __init__(self, config, layer, rotary, backend, cpu_kernels=None, reduce=None):
        super().__init__(config, layer, rotary, backend, cpu_kernels, reduce)
        # F.rms_norm, not the compiled kernel: q and k are strided views of the fused output here
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        qkv = super().project_qkv(x)
        n, q_end, k_end = qkv.shape[0], self.q_size, self.q_size + self.kv_size
        q = self.q_norm(qkv[:, :q_end].view(n, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim))
        return torch.cat((q.flatten(1), k.flatten(1), qkv[:, k_end:]), dim=1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    layer_class = Qwen3DecoderLayer
    takes_cpu_decoder = False  # the q/k norms
    hf_model_types = {"qwen3": QWEN_HF_DEFAULTS | {"head_dim": 128}}
    gguf_architectures = ("qwen3",)

    @classmethod
    def hf_fields(cls, hf):
        return {"qk_norm": True, **qwen_sliding_window(hf, used_only_with=None)}

    @classmethod
    def gguf_fields(cls, gguf):
        return {"qk_norm": True}
