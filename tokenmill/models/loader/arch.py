"""A decoder-only model's architecture, whatever file it came from: `ModelArchConfig`, and the
weight names and shapes a checkpoint of it holds (the family's Hugging Face names).

Which architectures there are, and what each family opens, is the model registry's
(models/__init__.py: MODEL_CLASSES, each class's loading declarations in models/base.py), read
through `model_classes`."""

from __future__ import annotations

from dataclasses import dataclass


def model_classes() -> dict[str, type]:
    """MODEL_CLASSES: architecture -> the family's class, in the registry's order. Imported when
    called, not at import: the model package imports this one, and is whole before a loader runs."""
    from tokenmill.models import MODEL_CLASSES

    return MODEL_CLASSES


def supported_architectures() -> tuple[str, ...]:
    return tuple(model_classes())

HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope_scaling types (Hugging Face's rope_type) that layers/rotary.py computes; "freq_factors" is
# a GGUF file's per-dimension divisors of the frequencies (its rope_freqs tensor).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class ModelArchConfig:
    """One decoder-only family's shape. The fields after `eos_token_ids` are what families add to
    the Llama baseline; their defaults are Llama's."""

    architecture: str  # normalized family: a key of MODEL_CLASSES (supported_architectures())
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # Hugging Face style ({"rope_type": "llama3", "factor": ...}) or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    hidden_act: str = "silu"  # the MLP gate's activation: one of HIDDEN_ACTIVATIONS
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + weight): 1.0 in Gemma
    # Norms on the attention and MLP outputs too, before each residual add (Gemma 2/3); the
    # layer's second norm is then `pre_feedforward_layernorm`.
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0  # embeddings are scaled by it (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale of q.k; None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # likewise for the logits
    sliding_window: int | None = None  # keys a query sees on a sliding layer (itself included)
    # Per layer "full_attention" | "sliding_attention"; None: every layer slides when
    # sliding_window is set (Mistral, Phi-3), else none.
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # the RoPE base of sliding layers when it differs (Gemma 3)
    # Mixture of experts: every layer's MLP routes each token to num_experts_per_tok of
    # num_experts experts of moe_intermediate_size (0: a dense MLP), plus a shared expert of
    # shared_expert_intermediate_size behind a sigmoid gate when that is > 0 (Qwen2-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' router weights are renormalized to sum to 1

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for a full-attention layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer attends within one window: K/V older than it is never read again."""
        return self.sliding_window is not None and all(
            self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    def __post_init__(self) -> None:
        if self.architecture not in (supported := supported_architectures()):
            raise ValueError(f"architecture={self.architecture!r}; supported: {', '.join(supported)}")
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r}; must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r}; must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r}; must be > 0")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"rope_scaling={self.rope_scaling!r}; must have a 'rope_type' key")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTIVATIONS)}")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_window={self.sliding_window!r}; must be a positive int or None")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types={self.layer_types!r}; must give one of {LAYER_TYPES} per layer")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attention_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}; must be > 0 or None")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                                 f"moe_intermediate_size={self.moe_intermediate_size}: need 0 < top-k <= experts "
                                 "and a positive expert size")
        for name, token_id in [("bos_token_id", self.bos_token_id)] + [
            ("eos_token_ids", i) for i in self.eos_token_ids
        ]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{name} has {token_id}; must be in [0, {self.vocab_size})")


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name a checkpoint with `config` must provide, with its PyTorch shape (the
    names of the family's Hugging Face checkpoints: its class's `attention_weight_shapes` and
    `mlp_weight_shapes`, and what every family has)."""
    family = model_classes()[config.architecture]
    hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
        }
        shapes |= family.attention_weight_shapes(config, layer)
        if config.attention_bias:
            shapes |= {
                f"{layer}.self_attn.q_proj.bias": (q_size,),
                f"{layer}.self_attn.k_proj.bias": (kv_size,),
                f"{layer}.self_attn.v_proj.bias": (kv_size,),
            }
        if config.qk_norm:
            shapes |= {f"{layer}.self_attn.q_norm.weight": (config.head_dim,),
                       f"{layer}.self_attn.k_norm.weight": (config.head_dim,)}
        if config.sandwich_norms:
            shapes |= {f"{layer}.pre_feedforward_layernorm.weight": (hidden,),
                       f"{layer}.post_feedforward_layernorm.weight": (hidden,)}
        shapes |= family.mlp_weight_shapes(config, layer)
    return shapes
