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
from tokenmill.models.loader.checkpoint import positive_or_none
from tokenmill.models.qwen2 import Qwen3Attention

# The defaults transformers uses for keys a Gemma config.json omits.
GEMMA_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                     "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}


def alternating_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every `pattern`-th layer global, the others sliding (Gemma's layout)."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def gemma_gguf_fields(gguf, pattern: int, num_layers_27b: int) -> dict:
    """What every Gemma GGUF adds to Llama's fields; llama.cpp's attention scale is 1/sqrt(hidden /
    heads) for the 27B size (`num_layers_27b` layers), else 1/sqrt(head_dim)."""
    big = gguf.num_layers == num_layers_27b
    return dict(hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True,
                embedding_multiplier=float(gguf.hidden_size) ** 0.5,
                attention_scale=(gguf.hidden_size / gguf.num_heads if big else gguf.head_dim) ** -0.5,
                sliding_window=int(gguf.get("attention.sliding_window", 4096)),
                layer_types=tuple(alternating_layer_types(gguf.num_layers, pattern)))


# Gemma's norms around both sublayers, as llama.cpp names them.
GEMMA_GGUF_TENSOR_NAMES = {
    "blk.{bid}.post_attention_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.pre_feedforward_layernorm.weight",
    "blk.{bid}.post_ffw_norm.weight": "model.layers.{bid}.post_feedforward_layernorm.weight",
}


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
    hf_model_types = {"gemma2": GEMMA_HF_DEFAULTS | {"rope_theta": 10000.0, "max_position_embeddings": 8192,
                                                     "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}
    hf_activation_aliases = {"gelu": "gelu_pytorch_tanh"}  # what transformers runs for Gemma whatever the config says
    gguf_architectures = ("gemma2",)
    gguf_norm_stored_plus_one = True
    gguf_tensor_names = GEMMA_GGUF_TENSOR_NAMES

    @classmethod
    def hf_fields(cls, hf):
        return {"norm_offset": 1.0, "sandwich_norms": True, "embedding_multiplier": int(hf.get("hidden_size")) ** 0.5,
                "attention_scale": float(hf.get("query_pre_attn_scalar")) ** -0.5,
                **hf.sliding_window(lambda: alternating_layer_types(hf.num_layers, 2))}

    @classmethod
    def gguf_fields(cls, gguf):
        return gemma_gguf_fields(gguf, pattern=2, num_layers_27b=46) | dict(
            attn_logit_softcap=positive_or_none(gguf.get("attn_logit_softcapping", 50.0)),
            final_logit_softcap=positive_or_none(gguf.get("final_logit_softcapping", 30.0)))

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
    hf_model_types = {"gemma3_text": GEMMA_HF_DEFAULTS | {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                                                          "max_position_embeddings": 131072, "sliding_window_pattern": 6}}
    hf_multimodal_model_types = {"gemma3": "a multimodal Gemma 3 checkpoint (model_type 'gemma3' with a vision tower) "
                                           "is not supported; its text-only sizes (model_type 'gemma3_text') are"}
    gguf_architectures = ("gemma3",)

    @classmethod
    def hf_fields(cls, hf):
        def layer_types() -> list[str]:
            raw = hf.raw
            pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
            return alternating_layer_types(hf.num_layers, int(pattern or hf.optional("sliding_window_pattern")))

        return {"norm_offset": 1.0, "sandwich_norms": True, "embedding_multiplier": int(hf.get("hidden_size")) ** 0.5,
                "attention_scale": float(hf.get("query_pre_attn_scalar")) ** -0.5, "qk_norm": True,
                **hf.sliding_window(layer_types)}

    @classmethod
    def gguf_fields(cls, gguf):
        return gemma_gguf_fields(gguf, pattern=6, num_layers_27b=62) | dict(qk_norm=True, local_rope_theta=10000.0)

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
