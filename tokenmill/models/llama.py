"""The decoder of every supported family: Llama 2/3 (SmolLM2), Mistral, Qwen2/2.5, Qwen3, Phi-3,
Gemma 2/3, and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE. The Llama layer
(RMSNorm, RoPE, GQA/MQA, SwiGLU, optional q/k/v bias, tied or untied LM head) plus what
`ModelArchConfig` says a family adds: q/k norms, GeGLU, Gemma's scaled embeddings, (1 + w) norms
and norms around both sublayers, sliding-window layers with their own RoPE base, soft-capped
attention scores and logits, and expert MLPs (`MoEMLP`).

The model sees a flat batch: `input_ids` and `positions` are `[num_tokens]` over every scheduled
token of every request in the step; matmuls run on the whole batch, attention is split at
sequence boundaries by the attention backend, using the metadata it built for the step. It knows nothing about scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import AttentionBackend, prefill_kernel_takes
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.sparsity import DOWN, GATE_UP, LINEAR_INPUTS, O, QKV, SparseInputs
from tokenmill.models.loader.arch import ModelArchConfig

KVCache = tuple[torch.Tensor, ...]  # (key, value), or 4 tensors when quantized: layers/attention/backend.py


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
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.window = config.layer_window(layer)  # None: full attention
        self.softcap = config.attn_logit_softcap
        # Which of the model's cos/sin tables this layer rotates with: 1 = the sliding layers' own base.
        self.rope_table = 1 if self.window is not None and config.local_rope_theta is not None else 0
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # over each head, before RoPE (F.rms_norm: q and k are strided views here)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend
        # The compiled CPU kernels (`layers.cpu_kernels`), whose `rope_write_kv` rotates q and k
        # and stores k and v (or their int8 codes and scales) in one call, rounding as
        # `rotary.apply` and `quantize_kv` do.
        self.kernel = cpu_kernels

    def forward(self, cos_sins, x, kv_cache: KVCache, meta, sparse: SparseInputs | None = None) -> torch.Tensor:
        """sparse: the layer's activation sparsity this step (layers/sparsity.py), None: dense."""
        n = x.shape[0]
        cos_sin = cos_sins[self.rope_table]
        qkv = self.qkv_proj(x if sparse is None else sparse(x, QKV))
        if self.q_norm is not None:
            q_end, k_end = self.q_size, self.q_size + self.kv_size
            q = self.q_norm(qkv[:, :q_end].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim))
            qkv = torch.cat((q.flatten(1), k.flatten(1), qkv[:, k_end:]), dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        fused = self.kernel is not None  # (the runner has no kernels with an fp8 cache)
        if fused:  # (an int8 cache: codes, codes, scales, scales)
            qk = self.kernel.rope_write_kv(qkv, *cos_sin, meta.slot_mapping, kv_cache[0], kv_cache[1], self.num_heads,
                                           self.num_kv_heads, *kv_cache[2:])
        else:  # queries and keys are adjacent in the fused output: rotate them in one go
            qk = self.rotary.apply(qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        extra = {} if self.window is None and self.softcap is None else {"window": self.window, "softcap": self.softcap}
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_written=fused, **extra)  # [n, num_heads, head_dim]
        o = o.reshape(n, self.q_size)
        out = self.o_proj(o if sparse is None else sparse(o, O))
        return out if self.reduce is None else self.reduce(out)


def activation(name: str):
    """The gate activation called `name` (ModelArchConfig.hidden_act) as transformers computes it."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class LlamaMLP(nn.Module):
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


class MoEMLP(nn.Module):
    """A mixture of experts: the router's softmax picks each token's top-k experts (weights
    renormalized when `norm_topk_prob`), each expert a SwiGLU MLP; Qwen2-MoE adds a shared expert
    scaled by a sigmoid gate. Tokens are sorted by expert and each expert with tokens runs one
    matmul over all of its rows (a loop over experts, never over tokens)."""

    def __init__(self, config: ModelArchConfig):
        super().__init__()
        e, inner, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k, self.norm_topk_prob, self.inner = config.num_experts_per_tok, config.norm_topk_prob, inner
        self.gate = nn.Linear(hidden, e, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * inner, hidden))  # each expert's gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, hidden, inner))
        self.act = activation(config.hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = weights.topk(self.top_k, dim=-1)  # [n, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // self.top_k
        rows = x[tokens]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                gate, up = F.linear(rows[start:end], self.w13[e]).split(self.inner, dim=-1)
                out_rows[start:end] = F.linear(self.act(gate) * up, self.w2[e])
                start = end
        out = torch.zeros_like(x).index_add_(0, tokens, out_rows * weights.flatten()[order, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                 cpu_kernels=None, reduce=None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        self.self_attn = LlamaAttention(config, layer, rotary, backend, cpu_kernels, reduce)
        self.post_attention_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        # Gemma: post_attention_layernorm normalizes the attention output; these the MLP's input and output.
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, cpu_kernels)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, cpu_kernels)
        self.mlp = MoEMLP(config) if config.num_experts else LlamaMLP(config, reduce=reduce)

    def forward(self, cos_sins, x, kv_cache: KVCache, meta, sparse: SparseInputs | None = None) -> torch.Tensor:
        """sparse: the layer's activation sparsity this step, None: dense (always for experts:
        enable_activation_sparsity refuses them)."""
        mlp_args = () if sparse is None else (sparse,)
        if self.pre_feedforward_layernorm is not None:
            x = x + self.post_attention_layernorm(self.self_attn(cos_sins, self.input_layernorm(x), kv_cache, meta, sparse))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), *mlp_args))
        x = x + self.self_attn(cos_sins, self.input_layernorm(x), kv_cache, meta, sparse)
        return x + self.mlp(self.post_attention_layernorm(x), *mlp_args)


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
    # An expert's checkpoint projections -> (our stacked parameter, shard within the expert):
    # Qwen-MoE's names, then Mixtral's.
    expert_modules: dict[str, tuple[str, int]] = {
        "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0),
        "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0),
    }

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, max_position: int, dtype: torch.dtype,
                 cpu_kernels=None, parallel=None, shard=None):
        """cpu_kernels: the compiled CPU kernels module (`layers.cpu_kernels.load()`) for the norms
        and the rotary embedding + KV store, or None for PyTorch ops; the attention backend brings
        its own. parallel, shard: this rank's `distributed.ParallelGroup` and `ShardPlan` when the
        model is split over ranks; `config` is then the rank's own shape (`ShardPlan.local_config`),
        and with tensor parallelism the embedding and LM head hold the rank's rows of the vocabulary."""
        super().__init__()
        self.config = config
        tp = parallel is not None and parallel.tp_size > 1
        reduce = parallel.all_reduce if tp else None
        self.parallel = parallel if tp else None  # for the vocabulary-parallel embedding and head
        self.vocab = shard.vocab_range() if tp else range(config.vocab_size)
        self.vocab_widths = shard.vocab_widths if tp else [config.vocab_size]
        self.attn_backend = backend  # every layer's; its build_metadata makes the step's `meta`
        self.rotary = rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling, dtype)
        # Sliding layers with their own RoPE base (Gemma 3) rotate with a second table.
        self.local_rotary = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, max_position, config.local_rope_theta, None, dtype)
        self.embed_tokens = nn.Embedding(len(self.vocab), config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary, backend, cpu_kernels, reduce)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.lm_head = nn.Linear(config.hidden_size, len(self.vocab), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The compiled DecoderStack (enable_cpu_decoder) for the steps it takes (_stack_takes), or None.
        self.cpu_decoder = None
        # Activation sparsity (enable_activation_sparsity): [num_layers, 4] float32 thresholds, or None.
        self.sparsity_thresholds: torch.Tensor | None = None
        self.sparsify_prefill = False

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns the final hidden states [num_tokens, hidden]."""
        return self.norm(self.run_layers(self.embed(input_ids), positions, kv_caches, meta))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta) -> torch.Tensor:
        """Every decoder layer of this model (of this pipeline stage) over x [num_tokens, hidden]."""
        rows = self.sparse_rows(x.shape[0], meta)
        if self.cpu_decoder is not None and self._stack_takes(meta, x.dtype, kv_caches):
            sparse = (self.sparsity_thresholds, rows) if rows else ()
            return self.cpu_decoder.forward(x, *self.rotary.lookup(positions), meta.slot_mapping, meta.decode_block_tables,
                                            meta.decode_seq_lens, kv_caches, meta.prefill_kernel_args, *sparse)
        cos_sins = self.rope_rows(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(cos_sins, x, kv_cache, meta, SparseInputs(self.sparsity_thresholds[i], rows) if rows else None)
        return x

    def sparse_rows(self, num_tokens: int, meta) -> int:
        """How many of the step's first tokens have their linears' inputs thresholded: none without
        activation sparsity, every token when prefill is sparsified too, else the decodes (first
        in the flat batch; a speculative verification's tokens are a chunk, dense)."""
        if self.sparsity_thresholds is None:
            return 0
        return num_tokens if self.sparsify_prefill else meta.num_decodes

    def enable_activation_sparsity(self, thresholds: torch.Tensor, prefill: bool = False) -> None:
        """Threshold the inputs of every decoder layer's linears (layers/sparsity.py) from now on:
        thresholds [num_layers, 4] in LINEAR_INPUTS order (q/k/v, o, gate/up, down), a decode step's
        rows only, or every row with `prefill` (accuracy measurements: every scored prompt token
        sparsified). Both the Python layers and the DecoderStack apply them. Raises ValueError for
        experts, whose MLP takes no thresholds, and for a thresholds tensor of another shape."""
        if self.config.num_experts:
            raise ValueError("activation sparsity: not for mixtures of experts (their MLP takes no thresholds)")
        shape = (len(self.layers), len(LINEAR_INPUTS))
        if tuple(thresholds.shape) != shape:
            raise ValueError(f"activation sparsity: thresholds of shape {tuple(thresholds.shape)}, expected {shape}")
        # (the final norm's weight: the embedding may be a quantized one, without a weight tensor)
        self.sparsity_thresholds = thresholds.to(device=self.norm.weight.device, dtype=torch.float32)
        self.sparsify_prefill = prefill

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input [num_tokens, hidden]. Split by vocabulary, each rank looks up the
        ids in its rows (zeros for the others') and the all-reduce adds them up."""
        if self.parallel is None:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.vocab.start
            outside = (local < 0) | (local >= len(self.vocab))
            x = self.parallel.all_reduce(self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0))
        if self.config.embedding_multiplier != 1.0:  # rounded to the model dtype first, as Gemma's reference does
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        return x

    def rope_rows(self, positions: torch.Tensor) -> tuple:
        """The step's rows of each RoPE table, shared by every layer: (cos, signed sin) of the
        model's base, then of the sliding layers' own base (None where there is none)."""
        return self.rotary.lookup(positions), self.local_rotary.lookup(positions) if self.local_rotary is not None else None

    def _stack_takes(self, meta, dtype: torch.dtype, kv_caches) -> bool:
        """Whether the DecoderStack runs this step: its decodes through the decode kernel (TorchAttentionBackend
        with kernels) and its prefill chunks, if any, through the prefill kernel; within every
        sliding window."""
        window = self.config.sliding_window
        if window is not None and window < meta.max_seq_len:
            return False
        if not meta.prefill_query_lens:
            return meta.decode_block_tables is not None
        return prefill_kernel_takes(meta, dtype, self.config.head_dim, kv_caches[0])

    def enable_cpu_decoder(self, kernels) -> bool:
        """Run the layers of decode-only steps, and of steps whose prefill chunks the prefill kernel
        takes, through `kernels.DecoderStack` (csrc/cpu_decoder.cpp: the same ops as
        `LlamaDecoderLayer`, bit-identical, without Python between them). For a
        model on the CPU, converted to its final linears, whose attention backend decodes with
        `kernels` (TorchAttentionBackend's decode kernel). False, and nothing changes, when a
        linear has no compiled form (w8a8, fp8) or the family's layer is not Llama's (q/k norms,
        GeGLU, sandwich norms, soft-capping, a second RoPE base, experts), nor with tensor
        parallelism (its all-reduces sit between the layers' ops)."""
        c = self.config
        if (c.qk_norm or c.hidden_act != "silu" or c.sandwich_norms or c.attn_logit_softcap is not None
                or c.local_rope_theta is not None or c.num_experts or self.parallel is not None):
            return False
        specs = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [getattr(lin, "cpu_decoder_spec", lambda: None)()
                       for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(spec is None for spec in linears):
                return False
            specs.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), *linears))
        attn = self.layers[0].self_attn
        self.cpu_decoder = kernels.DecoderStack(specs, self.norm.eps, c.num_attention_heads, c.num_key_value_heads,
                                                c.head_dim, c.intermediate_size, attn.scale)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> fp32 logits [num_rows, vocab] (soft-capped where the family caps them);
        split by vocabulary, every rank gets all the ranks' columns."""
        logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.gather_columns(logits, self.vocab_widths)
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _placement(self, params: dict, name: str) -> tuple[str, object, torch.Tensor] | None:
        """Where checkpoint tensor `name` (model. prefix removed) goes: (our parameter, its shard
        key, the view of the parameter to copy into); None when it has no place here."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules and "experts" not in parts:
            fused, shard = self.packed_modules[parts[-2]]
            ours = ".".join(parts[:-2] + [fused, parts[-1]])
            if ours not in params:
                return None
            target = params[ours]
            if fused == "qkv_proj":
                c = self.config
                sizes = [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
            else:
                sizes = [target.shape[0] // 2] * 2
            return ours, shard, target.narrow(0, sum(sizes[:shard]), sizes[shard])
        if "block_sparse_moe" in parts:  # Mixtral's name for the expert MLP
            parts[parts.index("block_sparse_moe")] = "mlp"
        if len(parts) == 7 and parts[2] == "mlp" and parts[3] == "experts" and parts[5] in self.expert_modules:
            stacked, half = self.expert_modules[parts[5]]
            ours, expert = ".".join(parts[:3] + [stacked]), int(parts[4])
            if ours not in params or expert >= params[ours].shape[0]:
                return None
            target = params[ours][expert]
            if stacked == "w13":
                inner = target.shape[0] // 2
                target = target.narrow(0, half * inner, inner)
            return ours, (expert, half), target
        ours = ".".join(parts)
        return (ours, self.whole_shard(ours), params[ours]) if ours in params else None

    @staticmethod
    def whole_shard(name: str) -> object:
        """The shard key of parameter `name` loaded whole: "all" for a fused linear's (fused in the
        checkpoint too, as in Phi-3), else 0."""
        parts = name.split(".")
        return "all" if len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj") else 0

    def _expected_shards(self, name: str, param: torch.Tensor) -> set:
        stem = name.rsplit(".", 1)[0].split(".")[-1]
        if stem == "qkv_proj":
            return {0, 1, 2}
        if stem == "gate_up_proj":
            return {0, 1}
        if name.endswith(".w13"):
            return {(e, h) for e in range(param.shape[0]) for h in (0, 1)}
        if name.endswith(".w2"):
            return {(e, 0) for e in range(param.shape[0])}
        return {0}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing packed ones and
        stacking experts; a Gemma norm's weight w becomes (1 + w). Raises ValueError naming any
        unexpected, mis-shaped or missing tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = {name: self._expected_shards(name, p) for name, p in params.items()}
        if self.config.tie_word_embeddings:
            expected.pop("lm_head.weight")
        loaded: dict[str, set] = {}
        offset = self.config.norm_offset
        for ckpt_name, tensor in weights:
            name = _strip_model_prefix(ckpt_name)
            place = self._placement(params, name)
            if place is None:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # some tied checkpoints carry a copy of the embedding
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            ours, shard, target = place
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            if offset and ours.endswith("norm.weight"):
                target.add_(offset)
            loaded.setdefault(ours, set()).add(shard)
        missing = sorted(n for n, shards in expected.items() if loaded.get(n, set()) not in (shards, {"all"}))
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' …' if len(missing) > 8 else ''}")


def _strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
