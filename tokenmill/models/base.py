"""What every model family shares: `CausalLM`, a decoder-only model — the embedding, the decoder
layers, the final norm and the LM head — with where each checkpoint tensor goes (`_placement`,
`load_weights`), the logits, activation sparsity and the compiled CPU decoder.

A family is one file, models/<family>.py, whose class subclasses `CausalLM` (or a family's class),
sets `layer_class` (its decoder layer, built from models/llama.py's attention and MLP or from its
own) and overrides what the family changes; models/__init__.py maps architecture names to these
classes (docs/adding_a_model.md).

The model sees a flat batch: `input_ids` and `positions` are `[num_tokens]` over every scheduled
token of every request in the step; matmuls run on the whole batch, attention is split at
sequence boundaries by the attention backend, using the metadata it built for the step. It knows
nothing about scheduling.

The compiled CPU decoder (csrc/cpu_decoder.cpp: `DecoderStack`, built by `enable_cpu_decoder`) is
the Llama-shaped fast path: one call runs every layer of a step with exactly the ops of
models/llama.py's `LlamaDecoderLayer` (RMSNorm, fused q/k/v with optional biases, RoPE and the KV
store, paged attention, o_proj, RMSNorm, SiLU-gated MLP), bit-identical to them. A family class
says with `takes_cpu_decoder` whether its layer is exactly that; every other family keeps its
Python layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers.attention import AttentionBackend, prefill_kernel_takes
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.sparsity import LINEAR_INPUTS, SparseInputs
from tokenmill.models.loader.arch import ModelArchConfig

KVCache = tuple[torch.Tensor, ...]  # (key, value), or 4 tensors when quantized: layers/attention/backend.py


class CausalLM(nn.Module):
    # The family's decoder layer: built as layer_class(config, layer index, rotary, backend,
    # cpu_kernels, reduce); its forward(cos_sins, x, kv_cache, meta, sparse) returns the new x
    # [num_tokens, hidden] (cos_sins: rope_rows; sparse: a SparseInputs or None).
    layer_class: ClassVar[type[nn.Module]]
    # Whether the family's layer computes exactly LlamaDecoderLayer's ops, so that the compiled
    # DecoderStack may stand in for it (enable_cpu_decoder). Every family class states it.
    takes_cpu_decoder: ClassVar[bool] = False
    # Checkpoint projections packed into one fused linear here: checkpoint name -> (our name, shard).
    # Shards are placed in the order listed for each fused linear.
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Whether the MLPs route tokens to experts (models/moe.py): a GGUF architecture name two
    # families share (llama.cpp's "llama": Llama and Mixtral) goes to the one whose experts match
    # the file's expert_count.
    has_experts: ClassVar[bool] = False

    # --- What checkpoints the family opens: models/loader/ reads these through MODEL_CLASSES. ---
    # Each family class states its own (a subclass does not answer to its base's names).
    # config.json model_type -> the defaults transformers uses for keys such a config omits.
    hf_model_types: ClassVar[dict[str, dict[str, Any]]] = {}
    # config.json model_types of a multimodal model around the family (a `text_config` beside a
    # vision tower) -> why it is refused.
    hf_multimodal_model_types: ClassVar[dict[str, str]] = {}
    # hidden_act values in its configs that mean another activation (Gemma's "gelu").
    hf_activation_aliases: ClassVar[dict[str, str]] = {}
    # GGUF general.architecture values the family answers to.
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    # llama.cpp interleaved each head's q/k rows for its "normal" RoPE (Llama); the loader undoes it.
    gguf_rows_permuted_for_rope: ClassVar[bool] = False
    # llama.cpp stores the norms as (1 + w) (Gemma); the loader hands out w, as in the checkpoint.
    gguf_norm_stored_plus_one: ClassVar[bool] = False
    # GGUF tensor name -> Hugging Face name ("{bid}": the layer) where the family's differ from
    # the loader's table (models/loader/gguf_loader.py: _GGUF_TO_HF).
    gguf_tensor_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def hf_fields(cls, hf) -> dict[str, Any]:
        """The ModelArchConfig fields of the family's config.json `hf` (models/loader/hf_loader.py:
        HfConfig) beyond those every family reads alike (sizes, norm eps, RoPE, activation,
        soft-caps, tokens): what the family adds to Llama's layer, its sliding window included.
        Raise ModelLoadError for what it cannot run."""
        return hf.sliding_window()

    @classmethod
    def gguf_fields(cls, gguf) -> dict[str, Any]:
        """As `hf_fields`, from a GGUF file's metadata `gguf` (models/loader/gguf_loader.py: GgufMetadata)."""
        return {}

    @classmethod
    def attention_weight_shapes(cls, config: ModelArchConfig, layer: str) -> dict[str, tuple[int, ...]]:
        """The q/k/v projection weights a checkpoint holds for layer `layer` ("model.layers.i"),
        with their PyTorch shapes (models/loader/arch.py: expected_weight_shapes adds the rest)."""
        hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        return {f"{layer}.self_attn.q_proj.weight": (q_size, hidden), f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
                f"{layer}.self_attn.v_proj.weight": (kv_size, hidden)}

    @classmethod
    def mlp_weight_shapes(cls, config: ModelArchConfig, layer: str) -> dict[str, tuple[int, ...]]:
        """As `attention_weight_shapes`, the MLP's weights."""
        hidden, ffn = config.hidden_size, config.intermediate_size
        return {f"{layer}.mlp.gate_proj.weight": (ffn, hidden), f"{layer}.mlp.up_proj.weight": (ffn, hidden),
                f"{layer}.mlp.down_proj.weight": (hidden, ffn)}

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
        self.embed_tokens = nn.Embedding(len(self.vocab), config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i, rotary, backend, cpu_kernels, reduce)
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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input [num_tokens, hidden]. Split by vocabulary, each rank looks up the
        ids in its rows (zeros for the others') and the all-reduce adds them up."""
        if self.parallel is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        return self.parallel.all_reduce(self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0))

    def rope_rows(self, positions: torch.Tensor) -> tuple:
        """The step's rows of each RoPE table, shared by every layer (a layer picks its table by
        its attention's `rope_table`): (cos, signed sin) of the model's base."""
        return (self.rotary.lookup(positions),)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> fp32 logits [num_rows, vocab]; split by vocabulary, every
        rank gets all the ranks' columns."""
        return self.vocab_logits(hidden).float()

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the whole vocabulary, in the model's dtype (where a family changes the
        logits before they become fp32: Gemma 2's soft-cap)."""
        logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.gather_columns(logits, self.vocab_widths)
        return logits

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
        a thresholds tensor of another shape (and, models/moe.py, for experts)."""
        shape = (len(self.layers), len(LINEAR_INPUTS))
        if tuple(thresholds.shape) != shape:
            raise ValueError(f"activation sparsity: thresholds of shape {tuple(thresholds.shape)}, expected {shape}")
        # (the final norm's weight: the embedding may be a quantized one, without a weight tensor)
        self.sparsity_thresholds = thresholds.to(device=self.norm.weight.device, dtype=torch.float32)
        self.sparsify_prefill = prefill

    def enable_cpu_decoder(self, kernels) -> bool:
        """Run the layers of decode-only steps, and of steps whose prefill chunks the prefill kernel
        takes, through `kernels.DecoderStack` (csrc/cpu_decoder.cpp: the ops of `LlamaDecoderLayer`,
        bit-identical, without Python between them). For a model on the CPU, converted to its final
        linears, whose attention backend decodes with `kernels` (TorchAttentionBackend's decode
        kernel). False, and nothing changes, when the family's layer is not Llama's
        (`takes_cpu_decoder`), its MLP's gate is not SiLU, a linear has no compiled form (w8a8,
        fp8), or with tensor parallelism (its all-reduces sit between the layers' ops)."""
        c = self.config
        if not self.takes_cpu_decoder or c.hidden_act != "silu" or self.parallel is not None:
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

    def _placement(self, params: dict, name: str) -> tuple[str, object, torch.Tensor] | None:
        """Where checkpoint tensor `name` (model. prefix removed) goes: (our parameter, its shard
        key, the view of the parameter to copy into); None when it has no place here."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules:
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
        return (name, self.whole_shard(name), params[name]) if name in params else None

    @staticmethod
    def whole_shard(name: str) -> object:
        """The shard key of parameter `name` loaded whole: "all" for a fused linear's (fused in the
        checkpoint too, as in Phi-3), else 0."""
        parts = name.split(".")
        return "all" if len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj") else 0

    def _expected_shards(self, name: str, param: torch.Tensor) -> set:
        """The shard keys parameter `name` is complete with (or {"all"}: loaded whole)."""
        stem = name.rsplit(".", 1)[0].split(".")[-1]
        if stem == "qkv_proj":
            return {0, 1, 2}
        if stem == "gate_up_proj":
            return {0, 1}
        return {0}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing packed ones (and
        stacking experts: models/moe.py); a norm's weight w becomes (norm_offset + w), as
        models/streaming.py does (Gemma's 1 + w). Raises ValueError naming any unexpected,
        mis-shaped or missing tensor."""
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
