"""Gemma 2 and Gemma 3: Llama's attention and gated MLP (GeGLU: ModelArchConfig.hidden_act) with
Gemma's changes:

- embeddings scaled by sqrt(hidden_size) (ModelArchConfig.embedding_multiplier);
- norms that scale by (1 + w): the loaders add the 1 to each norm's weight (`norm_offset`);
- norms around both sublayers, before each residual add (`GemmaDecoderLayer`);
- the softmax scale from query_pre_attn_scalar (`attention_scale`);
- sliding-window layers between global ones (every other in Gemma 2, 5 of every 6 in Gemma 3);
- Gemma 2: attention scores and logits soft-capped, cap * tanh(x / cap);
- Gemma 3: q/k norms (Qwen3's) and the sliding layers' own RoPE base, a second cos/sin table.

None of it is in the compiled CPU decoder: the Python layers run every step.
"""

from __future__ import annotations

import torch

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.base import CausalLM, KVCache
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer
from tokenmill.models.qwen2 import Qwen3Attention


class GemmaAttention(LlamaAttention):
    def __init__(self, config, layer, rotary, backend, cpu_kernels=None, reduce=None):
        super().__init__(config, layer, rotary, backend, cpu_kernels, reduce)
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_logit_softcap  # None: scores as they are
        if self.softcap is not None:
            self.backend_options = {**self.backend_options, "softcap": self.softcap}


class Gemma3Attention(Qwen3Attention, GemmaAttention):
    """Gemma's attention with Qwen3's q/k norms (whose weights get the 1 added too); a sliding
    layer rotates with its own RoPE base where it has one. (Each __init__ calls the next in the
    method order: this one, Qwen3Attention's norms, GemmaAttention's scale and cap, Llama's.)"""

    def __init__(self, config, layer, rotary, backend, cpu_kernels=None, reduce=None):
        super().__init__(config, layer, rotary, backend, cpu_kernels, reduce)
        if self.window is not None and config.local_rope_theta is not None:
            self.rope_table = 1  # Gemma3ForCausalLM.rope_rows


class GemmaDecoderLayer(LlamaDecoderLayer):
    """post_attention_layernorm normalizes the attention's output (in Llama: the MLP's input);
    pre_feedforward_layernorm and post_feedforward_layernorm the MLP's input and output."""

    attention_class = GemmaAttention

    def __init__(self, config, layer, rotary, backend, cpu_kernels=None, reduce=None):
        super().__init__(config, layer, rotary, backend, cpu_kernels, reduce)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, cpu_kernels)

    def forward(self, cos_sins, x, kv_cache: KVCache, meta, sparse=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(cos_sins, self.input_layernorm(x), kv_cache, meta, sparse))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), sparse))


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer
    takes_cpu_decoder = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # the multiplier rounded to the model dtype first, as Gemma's reference does
        return x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().vocab_logits(hidden)
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer
    takes_cpu_decoder = False

    def __init__(self, config, backend, max_position, dtype, cpu_kernels=None, parallel=None, shard=None):
        super().__init__(config, backend, max_position, dtype, cpu_kernels, parallel, shard)
        # The sliding layers' table (None where their base is the model's: they use the first).
        self.local_rotary = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, max_position, config.local_rope_theta, None, dtype)

    def rope_rows(self, positions: torch.Tensor) -> tuple:
        """(cos, signed sin) of the model's base, then of the sliding layers' own base."""
        if self.local_rotary is None:
            return super().rope_rows(positions)
        return self.rotary.lookup(positions), self.local_rotary.lookup(positions)
