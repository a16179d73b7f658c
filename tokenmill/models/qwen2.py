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
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    takes_cpu_decoder = True


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
