"""Llama 2/3 (SmolLM2) and Mistral: the Llama decoder layer — RMSNorm, RoPE, GQA/MQA, SwiGLU,
optional q/k/v biases, tied or untied LM head — whose attention and MLP the other families build
on (models/qwen2.py, phi3.py, gemma.py, mixtral.py, qwen2_moe.py). Mistral's sliding window is
the attention's `window` (ModelArchConfig.layer_window: any family's layers may slide).

This layer is what the compiled CPU decoder computes (csrc/cpu_decoder.cpp; models/base.py):
change its ops and the DecoderStack must change with them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.sparsity import DOWN, GATE_UP, O, QKV, SparseInputs
from tokenmill.models.base import CausalLM, KVCache
from tokenmill.models.loader.arch import ModelArchConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                 cpu_kernels=None, reduce=None):
        """reduce: with tensor parallelism, the all-reduce that sums the ranks' partial o_proj outputs."""
        super().__init__()
        self.reduce = reduce
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_window(layer)  # None: full attention
        # The backend's keyword arguments beyond the common ones (a family adds its own: Gemma's softcap).
        self.backend_options: dict = {} if self.window is None else {"window": self.window}
        # Which of the model's RoPE tables (CausalLM.rope_rows) this layer rotates with.
        self.rope_table = 0
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.backend = backend
        # The compiled CPU kernels (`layers.cpu_kernels`), whose `rope_write_kv` rotates q and k
        # and stores k and v (or their int8 codes and scales) in one call, rounding as
        # `rotary.apply` and `quantize_kv` do.
        self.kernel = cpu_kernels

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The fused q, k, v rows [num_tokens, q_size + 2 * kv_size] of x, before RoPE (where a
        family changes q or k first: Qwen3's norms)."""
        return self.qkv_proj(x)

    def forward(self, cos_sins, x, kv_cache: KVCache, meta, sparse: SparseInputs | None = None) -> torch.Tensor:
        """sparse: the layer's activation sparsity this step (layers/sparsity.py), None: dense."""
        n = x.shape[0]
        cos_sin = cos_sins[self.rope_table]
        qkv = self.project_qkv(x if sparse is None else sparse(x, QKV))
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        fused = self.kernel is not None  # (the runner has no kernels with an fp8 cache)
        if fused:  # (an int8 cache: codes, codes, scales, scales)
            qk = self.kernel.rope_write_kv(qkv, *cos_sin, meta.slot_mapping, kv_cache[0], kv_cache[1], self.num_heads,
                                           self.num_kv_heads, *kv_cache[2:])
        else:  # queries and keys are adjacent in the fused output: rotate them in one go
            qk = self.rotary.apply(qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_written=fused, **self.backend_options)  # [n, num_heads, head_dim]
        o = o.reshape(n, self.q_size)
        out = self.o_proj(o if sparse is None else sparse(o, O))
        return out if self.reduce is None else self.reduce(out)


def activation(name: str):
    """The gate activation called `name` (ModelArchConfig.hidden_act) as transformers computes it."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class LlamaMLP(nn.Module):
    """The gated MLP: act(gate) * up, then down; SwiGLU, or GeGLU where the config's activation says so (Gemma)."""

    def __init__(self, config: ModelArchConfig, intermediate_size: int | None = None, reduce=None):
        super().__init__()
        self.reduce = reduce  # as LlamaAttention's, for down_proj
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, sparse: SparseInputs | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x if sparse is None else sparse(x, GATE_UP)).split(self.intermediate_size, dim=-1)
        h = self.act(gate) * up
        out = self.down_proj(h if sparse is None else sparse(h, DOWN))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)). A family changes the attention through
    `attention_class`, the MLP through `make_mlp`, or the norms around them in `forward`."""

    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: ModelArchConfig, layer: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                 cpu_kernels=None, reduce=None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        self.self_attn = self.attention_class(config, layer, rotary, backend, cpu_kernels, reduce)
        self.post_attention_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        self.mlp = self.make_mlp(config, reduce)

    def make_mlp(self, config: ModelArchConfig, reduce) -> nn.Module:
        """The layer's MLP: forward(x, sparse) -> [num_tokens, hidden]."""
        return LlamaMLP(config, reduce=reduce)

    def forward(self, cos_sins, x, kv_cache: KVCache, meta, sparse: SparseInputs | None = None) -> torch.Tensor:
        """sparse: the layer's activation sparsity this step, None: dense."""
        x = x + self.self_attn(cos_sins, self.input_layernorm(x), kv_cache, meta, sparse)
        return x + self.mlp(self.post_attention_layernorm(x), sparse)


# The defaults transformers uses for keys a Llama-like config.json omits (the other families' start from them).
LLAMA_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
                     "tie_word_embeddings": False}


class LlamaForCausalLM(CausalLM):
    """Llama; the base of every family whose layer is exactly this one (Mistral, Qwen2, Phi-3),
    which the compiled CPU decoder takes."""

    layer_class = LlamaDecoderLayer
    takes_cpu_decoder = True
    hf_model_types = {"llama": LLAMA_HF_DEFAULTS}
    gguf_architectures = ("llama",)
    gguf_rows_permuted_for_rope = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layer; its sliding window is the config's. Its GGUF files say "llama" (same
    tensors, same q/k row order) and load as Llama."""

    takes_cpu_decoder = True
    hf_model_types = {"mistral": LLAMA_HF_DEFAULTS | {"max_position_embeddings": 4096 * 32}}
    gguf_architectures = ()
    gguf_rows_permuted_for_rope = False
