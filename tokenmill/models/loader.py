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
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # normalized family: "llama" | "qwen2" | "mistral"
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

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor in `[out, in]` layout), one tensor at a time.

        Tensors are read (and dequantized) lazily, each a fresh tensor the caller owns. Names are
        exactly those of `expected_weight_shapes(self.config)`, each once; `lm_head.weight` only
        when the head is untied. May be called again for a second pass.
        """
        return self._read_weights()


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
    """Every weight name a checkpoint with `config` must provide, with its PyTorch shape."""
    hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_size, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (ffn, hidden),
            f"{layer}.mlp.up_proj.weight": (ffn, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, ffn),
        }
        if config.attention_bias:
            shapes |= {
                f"{layer}.self_attn.q_proj.bias": (q_size,),
                f"{layer}.self_attn.k_proj.bias": (kv_size,),
                f"{layer}.self_attn.v_proj.bias": (kv_size,),
            }
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
    # RoPE halves are interleaved (its "normal" rope); Qwen2 uses NeoX rope and is stored as is.
    rows_permuted_for_rope: bool


# general.architecture -> family. Mistral GGUFs say "llama" (same tensors, same permutation).
_GGUF_ARCHS = {
    "llama": _GgufArch("llama", rows_permuted_for_rope=True),
    "qwen2": _GgufArch("qwen2", rows_permuted_for_rope=False),
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
    "blk.{bid}.attn_output.weight": "model.layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_gate.weight": "model.layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "model.layers.{bid}.mlp.down_proj.weight",
}

# GGUF tensors whose rows llama.cpp permuted (when the arch says so) -> how many heads they hold.
_GGUF_ROPE_PERMUTED_HEADS = {
    "attn_q": "num_attention_heads",
    "attn_k": "num_key_value_heads",
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str | None:
    if match := _LAYER_NAME.fullmatch(gguf_name):
        bid, part, kind = match.groups()
        template = _GGUF_TO_HF.get(f"blk.{{bid}}.{part}.{kind}")
        return template.format(bid=bid) if template else None
    return _GGUF_TO_HF.get(gguf_name)


def _undo_rope_permutation(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (i, half) go back from interleaved
    order [r0, r_d/2, r1, r_d/2+1, ...] to Hugging Face's two halves [r0, r1, ..., r_d/2, ...]."""
    head_rows = rows.shape[0] // num_heads
    permuted = rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:])
    return permuted.swapaxes(1, 2).reshape(rows.shape)


def _load_gguf(path: Path) -> LoadedCheckpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors on truncated or foreign files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc

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
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style per-dimension RoPE factors; no field of ModelArchConfig carries them.
        raise ModelLoadError(f"{path}: per-dimension RoPE frequency factors (rope_freqs) are not supported")

    config = _gguf_config(reader, path, gguf_arch, arch.architecture, tensors)
    hf_names = {}
    for name in tensors:
        hf_name = _hf_name(name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {name!r} for architecture {gguf_arch!r}")
        hf_names[name] = hf_name
    # GGUF lists dims innermost first: reversed, they are PyTorch's [out, in].
    _check_tensor_shapes(
        path, config, {hf_names[n]: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()}
    )

    permuted_heads = (
        {kind: getattr(config, attr) for kind, attr in _GGUF_ROPE_PERMUTED_HEADS.items()}
        if arch.rows_permuted_for_rope
        else {}
    )

    def read_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            # A plain-ndarray view: numpy's memmap subclass costs ~20% in dequantize's slicing.
            values = gguf.quants.dequantize(tensor.data.view(np.ndarray), tensor.tensor_type)
            values = np.asarray(values, dtype=np.float32)
            kind = tensor.name.split(".")[-2]
            if kind in permuted_heads:
                values = _undo_rope_permutation(values, permuted_heads[kind])
            if np.may_share_memory(values, tensor.data):  # a view of the read-only file mapping
                values = values.copy()
            yield hf_names[tensor.name], torch.from_numpy(np.ascontiguousarray(values))

    tokenizer = _gguf_tokenizer(path, reader)
    return LoadedCheckpoint(source=path, config=config, tokenizer=tokenizer, _read_weights=read_weights)


_MISSING = object()


def _gguf_field(reader: gguf.GGUFReader, path: Path, key: str, default: Any = _MISSING) -> Any:
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
    reader: gguf.GGUFReader, path: Path, gguf_arch: str, architecture: str, tensors: dict
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
    vocab_size = len(tokens.data) if tokens is not None else meta(f"{gguf_arch}.vocab_size")
    try:
        return ModelArchConfig(
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=int(hidden_size),
            intermediate_size=int(meta(f"{gguf_arch}.feed_forward_length")),
            num_hidden_layers=int(meta(f"{gguf_arch}.block_count")),
            num_attention_heads=int(num_heads),
            num_key_value_heads=int(meta(f"{gguf_arch}.attention.head_count_kv", num_heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(meta(f"{gguf_arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta(f"{gguf_arch}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(path, gguf_arch, meta),
            max_position_embeddings=int(meta(f"{gguf_arch}.context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_unique(
                [meta(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")]
            ),
        )
    except ValueError as exc:
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


def _gguf_tokenizer(path: Path, reader: gguf.GGUFReader) -> PreTrainedTokenizerBase:
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

# config.json model_type -> family, and the defaults transformers uses for keys a config omits.
_HF_MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": False},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096 * 32,
                "tie_word_embeddings": False},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
              "tie_word_embeddings": False},
}
assert _HF_MODEL_TYPES.keys() == set(SUPPORTED_ARCHITECTURES)

# Buffers some checkpoints carry that are recomputed from the config.
_HF_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)


def _load_hf_dir(directory: Path) -> LoadedCheckpoint:
    raw = _read_json(directory / "config.json", required=True)
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

    def read_weights() -> Iterator[tuple[str, torch.Tensor]]:
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
    if model_type not in _HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    defaults = _HF_MODEL_TYPES[model_type]
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu is)")

    def get(key: str) -> Any:
        value = raw.get(key)
        if value is None:
            value = defaults.get(key)
        if value is None:
            raise ModelLoadError(f"{source}: no {key!r}")
        return value

    # transformers 5 writes `rope_parameters` (theta included); older configs `rope_theta` and
    # `rope_scaling` (whose type key was once "type").
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or defaults["rope_theta"]
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None

    max_position = int(get("max_position_embeddings"))
    window = raw.get("sliding_window")
    slides = model_type == "mistral" or raw.get("use_sliding_window") or (
        "sliding_attention" in (raw.get("layer_types") or ())
    )
    if window and slides and window < max_position:
        # Within the window, sliding-window attention is plain causal attention.
        max_position = int(window)

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    generation = _read_json(directory / "generation_config.json", required=False) or {}
    eos_ids = []
    for eos in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        eos_ids.extend(eos if isinstance(eos, list) else [eos])
    try:
        return ModelArchConfig(
            architecture=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            # Qwen2 always has q/k/v biases; for Llama the flag also puts a bias on o_proj,
            # which the shape check then reports as unsupported.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_unique(eos_ids),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


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
