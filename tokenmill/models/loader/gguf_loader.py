"""A GGUF file as a `LoadedCheckpoint`: its metadata as a `ModelArchConfig`, its tensors under
Hugging Face names (dequantized with the `gguf` package in row chunks, q/k rows un-permuted, or
kept as int4 / int6 / int8 records), and the tokenizer and chat template rebuilt from its
metadata by transformers (cached on disk, since building it re-parses the whole file)."""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import mmap
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.models import gguf_blocks
from tokenmill.models.gguf_file import GgufFile, GgufFormatError
from tokenmill.models.loader.arch import ModelArchConfig, model_classes
from tokenmill.models.loader.checkpoint import LoadedCheckpoint, ModelLoadError, check_tensor_shapes, unique_ids

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase


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
# A mixture of experts' 3-D tensors, one slice per expert -> the part of the stacked expert
# parameters it fills (MoEForCausalLM.expert_modules), whose checkpoint name the family gives.
_GGUF_EXPERT_TENSORS = {"ffn_gate_exps": ("w13", 0), "ffn_up_exps": ("w13", 1), "ffn_down_exps": ("w2", 0)}

# GGUF tensors whose rows llama.cpp permuted (when the arch says so) -> how many heads they hold.
_GGUF_ROPE_PERMUTED_HEADS = {
    "attn_q": "num_attention_heads",
    "attn_k": "num_key_value_heads",
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_names(gguf_name: str, config: ModelArchConfig, family: type) -> list[str] | None:
    """The Hugging Face name(s) of GGUF tensor `gguf_name` (an expert tensor holds one per
    expert), or None when the family has no such tensor."""
    if match := _LAYER_NAME.fullmatch(gguf_name):
        bid, part, kind = match.groups()
        if part in _GGUF_EXPERT_TENSORS and kind == "weight" and config.num_experts:
            return [family.expert_weight_name(bid, e, _GGUF_EXPERT_TENSORS[part]) for e in range(config.num_experts)]
        key = f"blk.{{bid}}.{part}.{kind}"
        template = family.gguf_tensor_names.get(key) or _GGUF_TO_HF.get(key)
        return None if template is None else [template.format(bid=bid)]
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


def load_gguf(path: Path) -> LoadedCheckpoint:
    import gguf

    reader, gguf_arch = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    architecture, family = _gguf_family(reader, path, gguf_arch)
    config = _gguf_config(reader, path, gguf_arch, architecture, family, tensors)
    hf_names, shapes = _tensor_names(path, gguf_arch, config, family, tensors)
    check_tensor_shapes(path, config, shapes)

    permuted_heads = (
        {kind: getattr(config, attr) for kind, attr in _GGUF_ROPE_PERMUTED_HEADS.items()}
        if family.gguf_rows_permuted_for_rope
        else {}
    )
    stored_types = {names[0]: t.tensor_type.name for name, t in tensors.items() if (names := hf_names.get(name))
                    and len(names) == 1 and t.tensor_type.name not in gguf_blocks.FLOAT_TYPES}
    read_weights = functools.partial(_read_weights, gguf, reader, family.gguf_norm_stored_plus_one, hf_names, shapes,
                                     permuted_heads)
    tokenizer = _gguf_tokenizer(path, reader)
    return LoadedCheckpoint(source=path, config=config, tokenizer=tokenizer, _read_weights=read_weights,
                            stored_types=stored_types)


def _open_gguf(path: Path) -> tuple[GgufFile, str]:
    """The file's reader and its `general.architecture`, once the file is readable, whole and of
    a supported architecture (one a family class lists in `gguf_architectures`)."""
    try:
        reader = GgufFile(path)
    except (GgufFormatError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc

    gguf_arch = _gguf_field(reader, path, "general.architecture")
    supported = {name for family in model_classes().values() for name in family.gguf_architectures}
    if gguf_arch not in supported:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(sorted(supported))}"
        )
    names = set()
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes (truncated?)")
        names.add(t.name)
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise ModelLoadError(f"{path}: LongRoPE (rope_factors_long/short) is not supported")
    return reader, gguf_arch


def _gguf_family(reader: GgufFile, path: Path, gguf_arch: str) -> tuple[str, type]:
    """(architecture, family class) of a file of `gguf_arch`: the one family that lists it, or,
    where two do (llama.cpp writes Mixtral as "llama" with an expert count), the one whose MLPs
    have experts as the file does."""
    candidates = [(a, family) for a, family in model_classes().items() if gguf_arch in family.gguf_architectures]
    if len(candidates) == 1:
        return candidates[0]
    has_experts = bool(int(_gguf_field(reader, path, f"{gguf_arch}.expert_count", 0) or 0))
    return next((a, family) for a, family in candidates if family.has_experts == has_experts)


def _tensor_names(path: Path, gguf_arch: str, config: ModelArchConfig, family: type, tensors: dict
                  ) -> tuple[dict[str, list[str]], dict[str, tuple[int, ...]]]:
    """GGUF name -> its Hugging Face name(s), and Hugging Face name -> shape in PyTorch's layout.
    A tensor the family does not have is an error."""
    hf_names: dict[str, list[str]] = {}
    found: dict[str, tuple[int, ...]] = {}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":  # read into config.rope_scaling
            continue
        names = _hf_names(name, config, family)
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
    return hf_names, found


def _read_weights(gguf, reader: GgufFile, norm_plus_one: bool, hf_names: dict[str, list[str]],
                  shapes: dict[str, tuple[int, ...]], permuted_heads: dict[str, int], records: dict[str, str],
                  ) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """`LoadedCheckpoint.weights` of a GGUF file, in the file's order (`load_gguf` binds all but
    `records`)."""
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
        if norm_plus_one and kind.endswith("norm"):  # stored as (1 + w)
            values = values - 1.0
        if np.may_share_memory(values, tensor.data):  # a view of the read-only file mapping
            values = values.copy()
        _drop_file_pages(reader, tensor)
        if len(names) > 1:  # one slice per expert
            for name, part in zip(names, values):
                yield name, torch.from_numpy(np.ascontiguousarray(part))
        else:
            yield names[0], torch.from_numpy(np.ascontiguousarray(values)).view(shapes[names[0]])
        del values


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


@dataclass(frozen=True)
class GgufMetadata:
    """A GGUF file's metadata as a family's `gguf_fields` reads it, with the values every family
    reads alike (as stored: not yet checked or converted)."""

    path: Path
    reader: GgufFile
    architecture: str  # general.architecture: the prefix of the model's keys
    hidden_size: Any
    num_heads: Any
    head_dim: Any
    num_layers: int

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The model's metadata `key` ("attention.sliding_window" is "<architecture>.attention.sliding_window");
        `default` where the file has none, else ModelLoadError."""
        return _gguf_field(self.reader, self.path, f"{self.architecture}.{key}", default)


def _gguf_config(reader: GgufFile, path: Path, gguf_arch: str, architecture: str, family: type, tensors: dict
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
    extra = family.gguf_fields(GgufMetadata(path, reader, gguf_arch, hidden_size, num_heads, head_dim, num_layers))
    ffn = meta(f"{gguf_arch}.feed_forward_length", None) or extra.get("moe_intermediate_size")
    try:
        return ModelArchConfig(
            architecture=architecture,
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
            eos_token_ids=unique_ids(
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
