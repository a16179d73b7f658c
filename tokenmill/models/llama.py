"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): RMSNorm, RoPE, GQA/MQA, SwiGLU,
optional q/k/v bias, tied or untied LM head.

The model sees a flat batch: `input_ids` and `positions` are `[num_tokens]` over every scheduled
token of every request in the step; matmuls run on the whole batch, attention is split at
sequence boundaries by the attention backend, using the metadata it built for the step. It knows nothing about scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.attention import AttentionBackend, prefill_kernel_takes
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.loader import ModelArchConfig

KVCache = tuple[torch.Tensor, ...]  # (key, value), or 4 tensors when quantized: layers/attention/backend.py


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, cpu_kernels=None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.backend = backend
        # The compiled CPU kernels (`layers.cpu_kernels`), whose `rope_write_kv` rotates q and k
        # and stores k and v (or their int8 codes and scales) in one call, rounding as
        # `rotary.apply` and `quantize_kv` do.
        self.kernel = cpu_kernels

    def forward(self, cos_sin, x, kv_cache: KVCache, meta) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        fused = self.kernel is not None  # (the runner has no kernels with an fp8 cache)
        if fused:  # (an int8 cache: codes, codes, scales, scales)
            qk = self.kernel.rope_write_kv(qkv, *cos_sin, meta.slot_mapping, kv_cache[0], kv_cache[1], self.num_heads,
                                           self.num_kv_heads, *kv_cache[2:])
        else:  # queries and keys are adjacent in the fused output: rotate them in one go
            qk = self.rotary.apply(qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_written=fused)  # [n, num_heads, head_dim]
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, cpu_kernels=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.self_attn = LlamaAttention(config, rotary, backend, cpu_kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.mlp = LlamaMLP(config)

    def forward(self, cos_sin, x, kv_cache: KVCache, meta) -> torch.Tensor:
        x = x + self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections packed into one fused linear here: checkpoint name -> (our name, shard).
    # Shards are placed in the order listed for each fused linear.
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, max_position: int, dtype: torch.dtype,
                 cpu_kernels=None):
        """cpu_kernels: the compiled CPU kernels module (`layers.cpu_kernels.load()`) for the norms
        and the rotary embedding + KV store, or None for PyTorch ops; the attention backend brings
        its own."""
        super().__init__()
        self.config = config
        self.attn_backend = backend  # every layer's; its build_metadata makes the step's `meta`
        self.rotary = rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, backend, cpu_kernels)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The compiled DecoderStack (enable_cpu_decoder) for the steps it takes (_stack_takes), or None.
        self.cpu_decoder = None

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns the final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions)  # the same rows for every layer
        if self.cpu_decoder is not None and self._stack_takes(meta, x.dtype, kv_caches):
            x = self.cpu_decoder.forward(x, *cos_sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
                                         kv_caches, meta.prefill_kernel_args)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(cos_sin, x, kv_cache, meta)
        return self.norm(x)

    def _stack_takes(self, meta, dtype: torch.dtype, kv_caches) -> bool:
        """Whether the DecoderStack runs this step: its decodes through the decode kernel (TorchAttentionBackend
        with kernels) and its prefill chunks, if any, through the prefill kernel."""
        if not meta.prefill_query_lens:
            return meta.decode_block_tables is not None
        return prefill_kernel_takes(meta, dtype, self.config.head_dim, kv_caches[0])

    def enable_cpu_decoder(self, kernels) -> bool:
        """Run the layers of decode-only steps, and of steps whose prefill chunks the prefill kernel
        takes, through `kernels.DecoderStack` (csrc/cpu_decoder.cpp: the same ops as
        `LlamaDecoderLayer`, bit-identical, without Python between them). For a
        model on the CPU, converted to its final linears, whose attention backend decodes with
        `kernels` (TorchAttentionBackend's decode kernel). False, and nothing changes, when a
        linear has no compiled form (w8a8, fp8)."""
        specs = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [getattr(lin, "cpu_decoder_spec", lambda: None)()
                       for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(spec is None for spec in linears):
                return False
            specs.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), *linears))
        c, attn = self.config, self.layers[0].self_attn
        self.cpu_decoder = kernels.DecoderStack(specs, self.norm.eps, c.num_attention_heads, c.num_key_value_heads,
                                                c.head_dim, c.intermediate_size, attn.scale)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> fp32 logits [num_rows, vocab]."""
        return self.lm_head(hidden).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing packed ones.
        Raises ValueError naming any unexpected, mis-shaped or missing tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        num_shards = {fused: 1 + max(i for f, i in self.packed_modules.values() if f == fused) for fused, _ in self.packed_modules.values()}
        expected = {name: set(range(num_shards.get(name.split(".")[-2], 1))) for name in params}
        if self.config.tie_word_embeddings:
            expected.pop("lm_head.weight")
        loaded: dict[str, set[int]] = {}
        for ckpt_name, tensor in weights:
            name, shard = _strip_model_prefix(ckpt_name), 0
            parts = name.split(".")
            module = parts[-2] if len(parts) >= 2 else ""
            if module in self.packed_modules:
                fused, shard = self.packed_modules[module]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # some tied checkpoints carry a copy of the embedding
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            target = params[name]
            if module in self.packed_modules:
                sizes = self._shard_sizes(fused)
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.setdefault(name, set()).add(shard)
        missing = sorted(n for n, shards in expected.items() if loaded.get(n, set()) != shards)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' …' if len(missing) > 8 else ''}")


def _strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
