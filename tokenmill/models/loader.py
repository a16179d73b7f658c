"""Reading a checkpoint (a GGUF file or a Hugging Face directory) into one common form.

Whatever the format, a `LoadedCheckpoint` offers the same three things: a `ModelArchConfig`, a
tokenizer, and the weights under Hugging Face's Llama/Qwen2 names, in float32 and PyTorch's
`[out, in]` layout. Model code never sees GGUF names, quantized blocks or llama.cpp's q/k row
order. Everything that can be checked without reading tensor data (architecture, config,
tensor names and shapes, tokenizer) is checked in `load_checkpoint`, so a bad file fails there
with a `ModelLoadError` that names it, not halfway through building a model.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.models import gguf_blocks
from tokenmill.models.gguf_file import GgufFile, GgufFormatError

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe",
                           "qwen3_moe")
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope_scaling types (Hugging Face's rope_type) that layers/rotary.py computes; "freq_factors" is
# a GGUF file's per-dimension divisors of the frequencies (its rope_freqs tensor).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelArchConfig:
    """One decoder-only family's shape. The fields after `eos_token_ids` are what families add to
    the Llama baseline; their defaults are Llama's."""

    architecture: str  # normalized family, one of SUPPORTED_ARCHITECTURES
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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


@dataclass
class LoadedCheckpoint:
    source: Path
    config: ModelArchConfig
    tokenizer: PreTrainedTokenizerBase  # chat_template set when the checkpoint has one
    _read_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # A checkpoint written by `tokenmill quantize`: its config.json's quantization_config. Its
    # weights() are then the stored tensors as they are (tokenmill.quantization.quantize).
    quantization: dict | None = None
    # A GGUF file's quantized tensors: Hugging Face name -> GGUF block type ("Q4_K", "Q6_K", ...).
    stored_types: dict[str, str] = field(default_factory=dict)

    def weights(self, records: Mapping[str, str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
        """(Hugging Face name, float32 tensor in `[out, in]` layout), one tensor at a time; for
        a name in `records` (a GGUF file's quantized tensors: `stored_types`) the record of its
        method there instead (quantization/formats.py): "int4", the file's own codes (types of
        models.gguf_blocks.INT4_REPACKED, group size 32); "int6", the file's own codes and scales
        (Q6_K); "int8", requantized per output channel a block of rows at a time (no float32 copy
        of the whole tensor).

        Tensors are read (and dequantized) lazily, each a fresh tensor the caller owns. Names are
        exactly those of `expected_weight_shapes(self.config)`, each once; `lm_head.weight` only
        when the head is untied. May be called again for a second pass.
        """
        return self._read_weights(dict(records or {}))


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Open a `.gguf` file or a Hugging Face directory (see `registry.resolve_model`)."""
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model directory")


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name a checkpoint with `config` must provide, with its PyTorch shape (the
    names of the family's Hugging Face checkpoints)."""
    hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_size, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
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
        if config.architecture == "phi3":  # fused in the checkpoint as they are here
            shapes[f"{layer}.self_attn.qkv_proj.weight"] = (q_size + 2 * kv_size, hidden)
            shapes[f"{layer}.mlp.gate_up_proj.weight"] = (2 * ffn, hidden)
            shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, ffn)
        else:
            shapes |= {
                f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
                f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
                f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            }
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
        shapes |= _mlp_shapes(config, layer)
    return shapes


def _mlp_shapes(config: ModelArchConfig, layer: str) -> dict[str, tuple[int, ...]]:
    hidden, ffn = config.hidden_size, config.intermediate_size
    if config.architecture == "phi3":
        return {}
    if not config.num_experts:
        return {f"{layer}.mlp.gate_proj.weight": (ffn, hidden), f"{layer}.mlp.up_proj.weight": (ffn, hidden),
                f"{layer}.mlp.down_proj.weight": (hidden, ffn)}
    inner, shapes = config.moe_intermediate_size, {}
    if config.architecture == "mixtral":
        shapes[f"{layer}.block_sparse_moe.gate.weight"] = (config.num_experts, hidden)
        for e in range(config.num_experts):
            expert = f"{layer}.block_sparse_moe.experts.{e}"
            shapes |= {f"{expert}.w1.weight": (inner, hidden), f"{expert}.w3.weight": (inner, hidden),
                       f"{expert}.w2.weight": (hidden, inner)}
        return shapes
    shapes[f"{layer}.mlp.gate.weight"] = (config.num_experts, hidden)
    for e in range(config.num_experts):
        expert = f"{layer}.mlp.experts.{e}"
        shapes |= {f"{expert}.gate_proj.weight": (inner, hidden), f"{expert}.up_proj.weight": (inner, hidden),
                   f"{expert}.down_proj.weight": (hidden, inner)}
    if shared := config.shared_expert_intermediate_size:
        expert = f"{layer}.mlp.shared_expert"
        shapes |= {f"{expert}.gate_proj.weight": (shared, hidden), f"{expert}.up_proj.weight": (shared, hidden),
                   f"{expert}.down_proj.weight": (hidden, shared), f"{layer}.mlp.shared_expert_gate.weight": (1, hidden)}
    return shapes


def _check_tensor_shapes(source: Path, config: ModelArchConfig, found: dict[str, tuple[int, ...]]) -> None:
    """`found` (Hugging Face name -> shape) must hold exactly the expected tensors."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - found.keys())
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
    unexpected = sorted(found.keys() - expected.keys())
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors for a {config.architecture} model "
            f"(not supported): {', '.join(unexpected[:3])}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(found[name])}, expected {shape}")


def _unique(ids: list[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


# --------------------------------------------------------------------------------------------
# GGUF


@dataclass(frozen=True)
class _GgufArch:
    architecture: str  # our normalized family
    # llama.cpp's converter permutes the q/k rows of Llama checkpoints so that each head's two
    # RoPE halves are interleaved (its "normal" rope); the others use NeoX rope, stored as is.
    rows_permuted_for_rope: bool = False
    # llama.cpp stores Gemma's norm weights as (1 + w): the loader hands out w, as in the checkpoint.
    norm_stored_plus_one: bool = False


# general.architecture -> family. Mistral GGUFs say "llama" (same tensors, same permutation), and
# so do Mixtral's (with an expert count).
_GGUF_ARCHS = {
    "llama": _GgufArch("llama", rows_permuted_for_rope=True),
    "qwen2": _GgufArch("qwen2"),
    "qwen3": _GgufArch("qwen3"),
    "phi3": _GgufArch("phi3"),
    "gemma2": _GgufArch("gemma2", norm_stored_plus_one=True),
    "gemma3": _GgufArch("gemma3", norm_stored_plus_one=True),
    "qwen2moe": _GgufArch("qwen2_moe"),
    "qwen3moe": _GgufArch("qwen3_moe"),
}

# GGUF tensor name -> Hugging Face name; "{bid}" is the layer index.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{bid}.attn_norm.weight": "model.layers.{bid}.input_layernorm.weight",
    "blk.{bid}.attn_q.weight": "model.layers.{bid}.self_attn.q_proj.weight",
    "blk.{bid}.attn_k.weight": "model.layers.{bid}.self_attn.k_proj.weight",
    "blk.{bid}.attn_v.weight": "model.layers.{bid}.self_attn.v_proj.weight",
    "blk.{bid}.attn_q.bias": "model.layers.{bid}.self_attn.q_proj.bias",
    "blk.{bid}.attn_k.bias": "model.layers.{bid}.self_attn.k_proj.bias",
    "blk.{bid}.attn_v.bias": "model.layers.{bid}.self_attn.v_proj.bias",
    "blk.{bid}.attn_qkv.weight": "model.layers.{bid}.self_attn.qkv_proj.weight",
    "blk.{bid}.attn_q_norm.weight": "model.layers.{bid}.self_attn.q_norm.weight",
    "blk.{bid}.attn_k_norm.weight": "model.layers.{bid}.self_attn.k_norm.weight",
    "blk.{bid}.attn_output.weight": "model.layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_gate.weight": "model.layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "model.layers.{bid}.mlp.down_proj.weight",
    # mixtures of experts: the router, the shared expert and its gate
    "blk.{bid}.ffn_gate_inp.weight": "model.layers.{bid}.mlp.gate.weight",
    "blk.{bid}.ffn_gate_shexp.weight": "model.layers.{bid}.mlp.shared_expert.gate_proj.weight",
    "blk.{bid}.ffn_up_shexp.weight": "model.layers.{bid}.mlp.shared_expert.up_proj.weight",
    "blk.{bid}.ffn_down_shexp.weight": "model.layers.{bid}.mlp.shared_expert.down_proj.weight",
    "blk.{bid}.ffn_gate_inp_shexp.weight": "model.layers.{bid}.mlp.shared_expert_gate.weight",
}
# Where a family's tensors differ: Gemma's norms around both sublayers; Phi-3's fused gate/up.
_GGUF_TO_HF_BY_FAMILY = {
    "gemma2": {
        "blk.{bid}.post_attention_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
        "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.pre_feedforward_layernorm.weight",
        "blk.{bid}.post_ffw_norm.weight": "model.layers.{bid}.post_feedforward_layernorm.weight",
    },
    "phi3": {"blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.gate_up_proj.weight"},
}
_GGUF_TO_HF_BY_FAMILY["gemma3"] = _GGUF_TO_HF_BY_FAMILY["gemma2"]
# A mixture of experts' 3-D tensors, one slice per expert -> the per-expert name's projection.
_GGUF_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

# GGUF tensors whose rows llama.cpp permuted (when the arch says so) -> how many heads they hold.
_GGUF_ROPE_PERMUTED_HEADS = {
    "attn_q": "num_attention_heads",
    "attn_k": "num_key_value_heads",
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_names(gguf_name: str, config: ModelArchConfig) -> list[str] | None:
    """The Hugging Face name(s) of GGUF tensor `gguf_name` (an expert tensor holds one per
    expert), or None when the family has no such tensor."""
    family = config.architecture
    if match := _LAYER_NAME.fullmatch(gguf_name):
        bid, part, kind = match.groups()
        if part in _GGUF_EXPERT_TENSORS and kind == "weight" and config.num_experts:
            proj = _GGUF_EXPERT_TENSORS[part]
            if family == "mixtral":
                return [f"model.layers.{bid}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT_NAMES[proj]}.weight"
                        for e in range(config.num_experts)]
            return [f"model.layers.{bid}.mlp.experts.{e}.{proj}.weight" for e in range(config.num_experts)]
        key = f"blk.{{bid}}.{part}.{kind}"
        template = _GGUF_TO_HF_BY_FAMILY.get(family, {}).get(key) or _GGUF_TO_HF.get(key)
        if template is None:
            return None
        name = template.format(bid=bid)
        if family == "mixtral":
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        return [name]
    name = _GGUF_TO_HF.get(gguf_name)
    return [name] if name else None


# Rows dequantized at a time: gguf's numpy dequantization makes several float32 temporaries the
# size of its input, which for a 150k-token embedding would be gigabytes.
_DEQUANTIZE_CHUNK_BYTES = 16 << 20


def _drop_file_pages(reader, tensor) -> None:
    """Let the kernel drop the file pages of a tensor already read (read-only, file-backed: they
    would stay resident, a whole model file by the end of loading)."""
    mapping = reader.map
    if not hasattr(mapping, "madvise"):
        return
    page = mmap.PAGESIZE
    start = tensor.data_offset // page * page
    end = tensor.data_offset + tensor.n_bytes
    try:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # not supported here: the pages stay until evicted
        pass


def _dequantized_chunks(gguf, tensor_type, blocks: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 rows) of blocks [N, bytes per row], _DEQUANTIZE_CHUNK_BYTES of blocks at a time."""
    rows = max(1, _DEQUANTIZE_CHUNK_BYTES // blocks.shape[1])
    for start in range(0, blocks.shape[0], rows):
        yield start, np.asarray(gguf.quants.dequantize(blocks[start : start + rows], tensor_type), dtype=np.float32)


def _dequantize(gguf, tensor) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch's layout (`[out, in]`), dequantized in row chunks."""
    data = tensor.data.view(np.ndarray)  # numpy's memmap subclass costs ~20% in dequantize's slicing
    if data.ndim < 2 or data.nbytes <= _DEQUANTIZE_CHUNK_BYTES:
        return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
    flat = data.reshape(-1, data.shape[-1])
    out = None
    for start, w in _dequantized_chunks(gguf, tensor.tensor_type, flat):
        if out is None:
            out = np.empty((flat.shape[0], w.shape[1]), dtype=np.float32)
        out[start : start + len(w)] = w
    return out.reshape(*data.shape[:-1], out.shape[-1])


def _int8_record(gguf, tensor_type, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Blocks [N, bytes per row] of a GGUF tensor as an int8 record, requantized per output
    channel (as formats.quantize_int8) from their float32 values a chunk of rows at a time, in
    numpy: torch's temporaries, freed on a loading thread, stay resident in glibc's arenas."""
    codes, scales = None, np.empty(blocks.shape[0], dtype=np.float32)
    for start, w in _dequantized_chunks(gguf, tensor_type, blocks):
        if codes is None:
            codes = np.empty((blocks.shape[0], w.shape[1]), dtype=np.int8)
        s = np.maximum(np.abs(w).max(axis=1), np.float32(1e-12)) / np.float32(127)
        w /= s[:, None]
        codes[start : start + len(w)] = np.clip(np.rint(w, out=w), -127, 127)
        scales[start : start + len(w)] = s
    return {"codes": torch.from_numpy(codes), "scales": torch.from_numpy(scales)}


def _undo_rope_permutation(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (i, half) go back from interleaved
    order [r0, r_d/2, r1, r_d/2+1, ...] to Hugging Face's two halves [r0, r1, ..., r_d/2, ...]."""
    head_rows = rows.shape[0] // num_heads
    permuted = rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:])
    return permuted.swapaxes(1, 2).reshape(rows.shape)


def _load_gguf(path: Path) -> LoadedCheckpoint:
    import gguf

    try:
        reader = GgufFile(path)
    except (GgufFormatError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc

    gguf_arch = _gguf_field(reader, path, "general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(sorted(_GGUF_ARCHS))}"
        )
    arch = _GGUF_ARCHS[gguf_arch]
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes (truncated?)")
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ModelLoadError(f"{path}: LongRoPE (rope_factors_long/short) is not supported")

    config = _gguf_config(reader, path, gguf_arch, arch.architecture, tensors)
    hf_names: dict[str, list[str]] = {}
    found: dict[str, tuple[int, ...]] = {}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":  # read into config.rope_scaling
            continue
        names = _hf_names(name, config)
        if names is None:
            what = " (a mixture of experts' tensor: this file's experts are not in its metadata)" if "_exps" in name else ""
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {name!r} for architecture {gguf_arch!r}{what}")
        hf_names[name] = names
        # GGUF lists dims innermost first: reversed, they are PyTorch's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        for hf_name in names:
            found[hf_name] = shape[1:] if len(names) > 1 else shape
        if names[0].endswith("shared_expert_gate.weight") and len(shape) == 1:
            found[names[0]] = (1, *shape)
    _check_tensor_shapes(path, config, found)

    permuted_heads = (
        {kind: getattr(config, attr) for kind, attr in _GGUF_ROPE_PERMUTED_HEADS.items()}
        if arch.rows_permuted_for_rope
        else {}
    )

    stored_types = {names[0]: t.tensor_type.name for name, t in tensors.items() if (names := hf_names.get(name))
                    and len(names) == 1 and t.tensor_type.name not in gguf_blocks.FLOAT_TYPES}

    def read_weights(records: dict[str, str]) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
        for tensor in reader.tensors:
            if tensor.name not in hf_names:
                continue
            kind = tensor.name.split(".")[-2]
            names = hf_names[tensor.name]
            if names[0] in records:
                blocks = tensor.data.view(np.ndarray).reshape(-1, tensor.data.shape[-1])
                if records[names[0]] == "int4":
                    record = gguf_blocks.int4_record(tensor.tensor_type.name, blocks)
                elif records[names[0]] == "int6":
                    record = gguf_blocks.int6_record(tensor.tensor_type.name, blocks)
                else:
                    record = _int8_record(gguf, tensor.tensor_type, blocks)
                if kind in permuted_heads:  # every part of a record is per row
                    record = {k: torch.from_numpy(_undo_rope_permutation(v.numpy(), permuted_heads[kind]).copy())
                              for k, v in record.items()}
                _drop_file_pages(reader, tensor)
                yield names[0], record
                continue
            values = _dequantize(gguf, tensor)
            if kind in permuted_heads:
                values = _undo_rope_permutation(values, permuted_heads[kind])
            if arch.norm_stored_plus_one and kind.endswith("norm"):
                values = values - 1.0
            if np.may_share_memory(values, tensor.data):  # a view of the read-only file mapping
                values = values.copy()
            _drop_file_pages(reader, tensor)
            if len(names) > 1:  # one slice per expert
                for name, part in zip(names, values):
                    yield name, torch.from_numpy(np.ascontiguousarray(part))
            else:
                yield names[0], torch.from_numpy(np.ascontiguousarray(values)).view(found[names[0]])
            del values

    tokenizer = _gguf_tokenizer(path, reader)
    return LoadedCheckpoint(source=path, config=config, tokenizer=tokenizer, _read_weights=read_weights,
                            stored_types=stored_types)


_MISSING = object()


def _gguf_field(reader: GgufFile, path: Path, key: str, default: Any = _MISSING) -> Any:
    field_ = reader.fields.get(key)
    if field_ is None:
        if default is _MISSING:
            raise ModelLoadError(f"{path}: GGUF metadata has no {key!r}")
        return default
    try:
        return field_.contents()
    except Exception as exc:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is unreadable ({exc})") from exc


def _gguf_config(
    reader: GgufFile, path: Path, gguf_arch: str, architecture: str, tensors: dict
) -> ModelArchConfig:
    def meta(key: str, default: Any = _MISSING) -> Any:
        return _gguf_field(reader, path, key, default)

    hidden_size = meta(f"{gguf_arch}.embedding_length")
    num_heads = meta(f"{gguf_arch}.attention.head_count")
    head_dim = meta(f"{gguf_arch}.attention.key_length", None) or meta(
        f"{gguf_arch}.rope.dimension_count", hidden_size // num_heads
    )
    rope_dim = meta(f"{gguf_arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: partial rotary (rope dims {rope_dim} of head_dim {head_dim}) is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else meta(f"{gguf_arch}.vocab_size")
    num_layers = int(meta(f"{gguf_arch}.block_count"))
    rope_scaling = _gguf_rope_scaling(path, gguf_arch, meta)
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: llama.cpp divides each frequency by its factor
        if rope_scaling is not None:
            raise ModelLoadError(f"{path}: both rope_freqs and RoPE scaling metadata")
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    family, extra = architecture, {}
    expert_count = int(meta(f"{gguf_arch}.expert_count", 0) or 0)
    if gguf_arch == "llama" and expert_count:
        family = "mixtral"
    if family in ("gemma2", "gemma3"):
        # llama.cpp's attention scale: 1/sqrt(hidden / heads) for the 27B sizes, else 1/sqrt(head_dim).
        big = num_layers == (46 if family == "gemma2" else 62)
        window = int(meta(f"{gguf_arch}.attention.sliding_window", 4096))
        pattern = 2 if family == "gemma2" else 6
        extra = dict(hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True,
                     embedding_multiplier=float(hidden_size) ** 0.5,
                     attention_scale=(hidden_size / num_heads if big else head_dim) ** -0.5,
                     sliding_window=window,
                     layer_types=tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)))
        if family == "gemma2":
            extra |= dict(attn_logit_softcap=_positive_or_none(meta("gemma2.attn_logit_softcapping", 50.0)),
                          final_logit_softcap=_positive_or_none(meta("gemma2.final_logit_softcapping", 30.0)))
        else:
            extra |= dict(qk_norm=True, local_rope_theta=10000.0)
    elif family in ("qwen3", "qwen3_moe"):
        extra = dict(qk_norm=True)
    elif family == "phi3":
        window = meta("phi3.attention.sliding_window", None)
        extra = dict(sliding_window=int(window) if window else None)
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        extra |= dict(num_experts=expert_count, num_experts_per_tok=int(meta(f"{gguf_arch}.expert_used_count")),
                      moe_intermediate_size=int(meta(f"{gguf_arch}.expert_feed_forward_length", None)
                                                or meta(f"{gguf_arch}.feed_forward_length")),
                      shared_expert_intermediate_size=int(meta(f"{gguf_arch}.expert_shared_feed_forward_length", 0)),
                      norm_topk_prob=family != "qwen2_moe")
    ffn = meta(f"{gguf_arch}.feed_forward_length", None) or extra.get("moe_intermediate_size")
    try:
        return ModelArchConfig(
            architecture=family,
            vocab_size=int(vocab_size),
            hidden_size=int(hidden_size),
            intermediate_size=int(ffn),
            num_hidden_layers=num_layers,
            num_attention_heads=int(num_heads),
            num_key_value_heads=int(meta(f"{gguf_arch}.attention.head_count_kv", num_heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(meta(f"{gguf_arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta(f"{gguf_arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(meta(f"{gguf_arch}.context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_unique(
                [meta(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")]
            ),
            **extra,
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: bad model metadata: {exc}") from exc


def _gguf_rope_scaling(path: Path, gguf_arch: str, meta: Callable[..., Any]) -> dict | None:
    kind = meta(f"{gguf_arch}.rope.scaling.type", "none")
    factor = meta(f"{gguf_arch}.rope.scaling.factor", None) or meta(f"{gguf_arch}.rope.scale_linear", None)
    if kind == "none" and factor is None:
        return None
    if kind in ("none", "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(meta(f"{gguf_arch}.rope.scaling.original_context_length")),
        }
    raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (linear, yarn are)")


def _gguf_tokenizer(path: Path, reader: GgufFile) -> PreTrainedTokenizerBase:
    stat = path.stat()
    tokenizer = copy.deepcopy(_gguf_tokenizer_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    if not tokenizer.chat_template:
        template = _gguf_field(reader, path, "tokenizer.chat_template", None)
        if template:
            tokenizer.chat_template = template
    return tokenizer


# Tokenizers built from GGUF metadata, saved as ordinary tokenizer files (one directory per
# GGUF file version), so a later process loads them in a fraction of a second.
TOKENIZER_CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "gguf-tokenizers"


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer_cached(path: str, size: int, mtime_ns: int) -> PreTrainedTokenizerBase:
    """Building a tokenizer from GGUF metadata takes seconds (transformers parses the whole
    file again). Loads of the same unchanged file share one in this process (callers get a deep
    copy), and it is kept on disk in TOKENIZER_CACHE_DIR, keyed by path, size and mtime."""
    from transformers import AutoTokenizer

    file = Path(path)
    key = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()[:24]
    cached = TOKENIZER_CACHE_DIR / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # noqa: BLE001 - a damaged cache entry is rebuilt below
            _log.warning("ignoring the cached tokenizer %s: %s", cached, exc)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:
        raise ModelLoadError(f"{file}: cannot build the tokenizer from GGUF metadata ({exc})") from exc
    try:
        partial = cached.with_name(f"{key}.tmp{os.getpid()}")
        tokenizer.save_pretrained(str(partial))
        os.replace(partial, cached)  # atomic: concurrent processes never see half a directory
    except OSError as exc:
        _log.debug("not caching the tokenizer of %s: %s", file, exc)
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


# --------------------------------------------------------------------------------------------
# Hugging Face directory

# config.json model_type -> (family, the defaults transformers uses for keys a config omits).
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False}
_GEMMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}
_HF_MODEL_TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", _LLAMA_DEFAULTS),
    "mistral": ("mistral", _LLAMA_DEFAULTS | {"max_position_embeddings": 4096 * 32}),
    "qwen2": ("qwen2", _LLAMA_DEFAULTS | {"max_position_embeddings": 32768}),
    "qwen3": ("qwen3", _LLAMA_DEFAULTS | {"max_position_embeddings": 32768, "head_dim": 128}),
    "phi3": ("phi3", _LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}),
    "gemma2": ("gemma2", _GEMMA_DEFAULTS | {"rope_theta": 10000.0, "max_position_embeddings": 8192,
                                            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3_text": ("gemma3", _GEMMA_DEFAULTS | {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                                                 "max_position_embeddings": 131072, "sliding_window_pattern": 6}),
    "mixtral": ("mixtral", _LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                                              "max_position_embeddings": 4096 * 32, "num_local_experts": 8,
                                              "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", _LLAMA_DEFAULTS | {"max_position_embeddings": 32768, "num_experts": 60,
                                                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False}),
    "qwen3_moe": ("qwen3_moe", _LLAMA_DEFAULTS | {"max_position_embeddings": 32768, "head_dim": 128, "num_experts": 128,
                                                  "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                                  "norm_topk_prob": False}),
}
assert {family for family, _ in _HF_MODEL_TYPES.values()} == set(SUPPORTED_ARCHITECTURES)

# Buffers some checkpoints carry that are recomputed from the config.
_HF_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)


def _load_hf_dir(directory: Path) -> LoadedCheckpoint:
    raw = _read_json(directory / "config.json", required=True)
    if isinstance(raw.get("tokenmill_arch"), dict):  # written by `tokenmill quantize`: the config as it was
        config = arch_config_from_dict(directory / "config.json", raw["tokenmill_arch"])
    else:
        config = _hf_config(directory, raw)
    quantization = raw.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") != "tokenmill":
        raise ModelLoadError(f"{directory}: quantization_config {quantization.get('quant_method')!r} is not supported "
                             "(checkpoints written by `tokenmill quantize` are)")

    files = _safetensors_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    tensor_file: dict[str, Path] = {}
    for file in files:
        for name, shape in _safetensors_shapes(file).items():
            if name.endswith(_HF_SKIPPED_SUFFIXES):
                continue
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # a saved copy of the tied embedding
            shapes[name], tensor_file[name] = shape, file
    if quantization is None:
        _check_tensor_shapes(directory, config, shapes)

    def read_weights(records: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
        if records:
            raise ValueError(f"{directory}: a Hugging Face checkpoint has no GGUF blocks to repack")
        from safetensors import safe_open

        for file in files:
            names = [name for name, f in tensor_file.items() if f == file]
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    # Quantized records as stored, in fresh (aligned) memory: kernels such as
                    # _weight_int8pack_mm crash on a tensor at an odd offset of the file.
                    yield name, tensor.clone() if quantization is not None else tensor.to(torch.float32)

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
    return LoadedCheckpoint(source=directory, config=config, tokenizer=tokenizer, _read_weights=read_weights, quantization=quantization)


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: no {path.name} (not a Hugging Face model directory)")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _hf_config(directory: Path, raw: dict) -> ModelArchConfig:
    source = directory / "config.json"
    model_type = raw.get("model_type")
    if model_type == "gemma3" and "text_config" in raw:
        raise ModelLoadError(f"{source}: a multimodal Gemma 3 checkpoint (model_type 'gemma3' with a vision tower) "
                             "is not supported; its text-only sizes (model_type 'gemma3_text') are")
    if model_type not in _HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    family, defaults = _HF_MODEL_TYPES[model_type]

    def get(key: str) -> Any:
        value = raw.get(key)
        if value is None:
            value = defaults.get(key)
        if value is None:
            raise ModelLoadError(f"{source}: no {key!r}")
        return value

    def optional(key: str) -> Any:
        return raw[key] if key in raw else defaults.get(key)

    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or defaults.get("hidden_activation", "silu")
    if hidden_act == "gelu" and family.startswith("gemma"):
        hidden_act = "gelu_pytorch_tanh"  # what transformers runs for Gemma whatever the config says
    if hidden_act not in HIDDEN_ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported ({', '.join(HIDDEN_ACTIVATIONS)} are)")
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial rotary (partial_rotary_factor {raw['partial_rotary_factor']}) "
                             "is not supported")
    num_layers = int(get("num_hidden_layers"))
    rope_theta, rope_scaling, local_theta = _hf_rope(source, raw, defaults)
    window, layer_types = _hf_sliding_window(raw, family, num_layers, optional)

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    head_dim = int(raw.get("head_dim") or defaults.get("head_dim") or hidden_size // num_heads)
    generation = _read_json(directory / "generation_config.json", required=False) or {}
    eos_ids = []
    for eos in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        eos_ids.extend(eos if isinstance(eos, list) else [eos])
    gemma = family in ("gemma2", "gemma3")
    try:
        return ModelArchConfig(
            architecture=family,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("max_position_embeddings")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            # Qwen2 and Qwen2-MoE always have q/k/v biases; for Llama the flag also puts a bias on
            # o_proj, which the shape check then reports as unsupported.
            attention_bias=family in ("qwen2", "qwen2_moe") or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_unique(eos_ids),
            hidden_act=hidden_act,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embedding_multiplier=hidden_size**0.5 if gemma else 1.0,
            attention_scale=float(get("query_pre_attn_scalar")) ** -0.5 if gemma else None,
            attn_logit_softcap=_positive_or_none(optional("attn_logit_softcapping")),
            final_logit_softcap=_positive_or_none(optional("final_logit_softcapping")),
            sliding_window=window,
            layer_types=layer_types,
            local_rope_theta=local_theta,
            **_hf_moe(source, raw, family, get, optional),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


def arch_config_from_dict(source: Path, values: dict) -> ModelArchConfig:
    """A ModelArchConfig from `dataclasses.asdict` of one (as `tokenmill quantize` stores it)."""
    values = dict(values)
    for key in ("eos_token_ids", "layer_types"):
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    try:
        return ModelArchConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: bad tokenmill_arch ({exc})") from exc


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


def _hf_rope(source: Path, raw: dict, defaults: dict) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own base or None) from a config.json.

    transformers 5 writes `rope_parameters` (theta included; per layer type for Gemma 3); older
    configs `rope_theta` and `rope_scaling` (whose type key was once "type"), and Gemma 3's
    sliding layers' base as `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    local_theta = raw.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", local_theta)
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: RoPE scaling on sliding layers ({local['rope_type']!r}) is not supported")
        params = params.get("full_attention") or {}
    rope = dict(params)
    rope_theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or defaults["rope_theta"]
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.pop("partial_rotary_factor", None)
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = int(raw.get("original_max_position_embeddings")
                                                        or raw.get("max_position_embeddings"))
    if rope_type == "yarn" and rope.get("factor") is None:
        rope["factor"] = raw["max_position_embeddings"] / rope["original_max_position_embeddings"]
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: RoPE scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)")
    rope_scaling = rope if rope_type != "default" else None
    local = float(local_theta) if local_theta is not None and float(local_theta) != float(rope_theta) else None
    return float(rope_theta), rope_scaling, local


def _hf_sliding_window(raw: dict, family: str, num_layers: int, optional: Callable[[str], Any]
                       ) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers reads them for the family."""
    window = optional("sliding_window")
    if not window or (family == "qwen2" or family.endswith("_moe")) and not raw.get("use_sliding_window"):
        return None, None  # Qwen configs carry a window they do not use unless use_sliding_window
    layer_types = raw.get("layer_types")
    if layer_types is None and family == "gemma2":
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if layer_types is None and family == "gemma3":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or optional("sliding_window_pattern"))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None and family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        first_full = raw.get("max_window_layers", num_layers)  # the layers below it slide
        layer_types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers)]
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None, None
    return int(window), tuple(layer_types) if layer_types is not None else None


def _hf_moe(source: Path, raw: dict, family: str, get: Callable[[str], Any], optional: Callable[[str], Any]) -> dict:
    """The mixture-of-experts fields of ModelArchConfig ({} for a dense family)."""
    if family == "mixtral":
        return {"num_experts": int(get("num_local_experts")), "num_experts_per_tok": int(get("num_experts_per_tok")),
                "moe_intermediate_size": int(get("intermediate_size")), "norm_topk_prob": True}
    if family not in ("qwen2_moe", "qwen3_moe"):
        return {}
    if int(raw.get("decoder_sparse_step") or 1) != 1 or raw.get("mlp_only_layers"):
        raise ModelLoadError(f"{source}: dense MLP layers between expert layers (decoder_sparse_step "
                             f"{raw.get('decoder_sparse_step')}, mlp_only_layers {raw.get('mlp_only_layers')}) "
                             "are not supported")
    experts = raw.get("num_experts") or raw.get("num_local_experts") or get("num_experts")  # transformers 5 writes the latter
    return {"num_experts": int(experts), "num_experts_per_tok": int(get("num_experts_per_tok")),
            "moe_intermediate_size": int(get("moe_intermediate_size")),
            "shared_expert_intermediate_size": int(optional("shared_expert_intermediate_size") or 0),
            "norm_topk_prob": bool(optional("norm_topk_prob"))}


def _safetensors_files(directory: Path) -> list[Path]:
    index = _read_json(directory / "model.safetensors.index.json", required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{directory / 'model.safetensors.index.json'}: no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{directory}: shard {file.name} named in model.safetensors.index.json is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = [p.name for p in directory.glob("*.bin")]
        hint = f" ({', '.join(others)} found; only safetensors are supported)" if others else ""
        raise ModelLoadError(f"{directory}: no model.safetensors (no *.safetensors file){hint}")
    return files


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # SafetensorError, OSError, ... on corrupt or truncated files
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
