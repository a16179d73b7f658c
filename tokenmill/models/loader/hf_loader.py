"""A Hugging Face model directory as a `LoadedCheckpoint`: config.json (and
generation_config.json) as a `ModelArchConfig` with the defaults transformers uses, the
safetensors files (sharded or not) read lazily, and the directory's tokenizer. A directory
`tokenmill quantize` wrote carries its config as it was and its quantized records as stored.

The family is the registry class whose `hf_model_types` holds the config's model_type; it gives
the defaults and, through `hf_fields`, what it adds to Llama's fields (models/base.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.loader.arch import HIDDEN_ACTIVATIONS, ROPE_TYPES, ModelArchConfig, model_classes
from tokenmill.models.loader.checkpoint import (
    LoadedCheckpoint, ModelLoadError, check_tensor_shapes, positive_or_none, unique_ids,
)

# Buffers some checkpoints carry that are recomputed from the config.
_HF_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(directory: Path) -> LoadedCheckpoint:
    raw = _read_json(directory / "config.json", required=True)
    if isinstance(raw.get("tokenmill_arch"), dict):  # written by `tokenmill quantize`: the config as it was
        config = arch_config_from_dict(directory / "config.json", raw["tokenmill_arch"])
    else:
        config = arch_config_from_hf(directory, raw)
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
        check_tensor_shapes(directory, config, shapes)

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


@dataclass(frozen=True)
class HfConfig:
    """A config.json as a family's `hf_fields` reads it: the config's values, else the family's
    defaults (its `hf_model_types` entry)."""

    source: Path  # the config.json, for messages
    raw: dict
    defaults: dict[str, Any]

    def get(self, key: str) -> Any:
        """The value of `key`, its default where the config has none; ModelLoadError if neither."""
        value = self.raw.get(key)
        if value is None:
            value = self.defaults.get(key)
        if value is None:
            raise ModelLoadError(f"{self.source}: no {key!r}")
        return value

    def optional(self, key: str) -> Any:
        """The config's `key` as written (None included), else its default or None."""
        return self.raw[key] if key in self.raw else self.defaults.get(key)

    @property
    def num_layers(self) -> int:
        return int(self.get("num_hidden_layers"))

    def sliding_window(self, default_layer_types: Callable[[], list[str]] | None = None,
                       used_only_with: str | None = None) -> dict[str, Any]:
        """sliding_window and layer_types as transformers reads them. default_layer_types: the
        family's layer pattern where the config lists none (None: every layer slides);
        used_only_with: a key without which the config's window is not used (Qwen's
        use_sliding_window)."""
        window = self.optional("sliding_window")
        if not window or used_only_with and not self.raw.get(used_only_with):
            return {"sliding_window": None, "layer_types": None}
        layer_types = self.raw.get("layer_types")
        if layer_types is None and default_layer_types is not None:
            layer_types = default_layer_types()
        if layer_types is not None and "sliding_attention" not in layer_types:
            return {"sliding_window": None, "layer_types": None}
        return {"sliding_window": int(window), "layer_types": tuple(layer_types) if layer_types is not None else None}


def _hf_family(source: Path, raw: dict) -> tuple[str, type, dict[str, Any]]:
    """(architecture, family class, its defaults) of the config's model_type."""
    model_type = raw.get("model_type")
    classes = model_classes()
    for architecture, family in classes.items():
        if model_type in family.hf_model_types:
            return architecture, family, family.hf_model_types[model_type]
    for family in classes.values():
        if model_type in family.hf_multimodal_model_types and "text_config" in raw:
            raise ModelLoadError(f"{source}: {family.hf_multimodal_model_types[model_type]}")
    supported = [name for family in classes.values() for name in family.hf_model_types]
    raise ModelLoadError(f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(supported)}")


def arch_config_from_hf(directory: Path, raw: dict) -> ModelArchConfig:
    """The ModelArchConfig of config.json `raw` in `directory` (with its generation_config.json,
    if any): its family's (`_hf_family`) defaults and fields, read as transformers reads them."""
    source = directory / "config.json"
    architecture, family, defaults = _hf_family(source, raw)
    hf = HfConfig(source, raw, defaults)
    get, optional = hf.get, hf.optional

    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or defaults.get("hidden_activation", "silu")
    hidden_act = family.hf_activation_aliases.get(hidden_act, hidden_act)
    if hidden_act not in HIDDEN_ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported ({', '.join(HIDDEN_ACTIVATIONS)} are)")
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial rotary (partial_rotary_factor {raw['partial_rotary_factor']}) "
                             "is not supported")
    num_layers = hf.num_layers
    rope_theta, rope_scaling, local_theta = _hf_rope(source, raw, defaults)

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    head_dim = int(raw.get("head_dim") or defaults.get("head_dim") or hidden_size // num_heads)
    generation = _read_json(directory / "generation_config.json", required=False) or {}
    eos_ids = []
    for eos in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        eos_ids.extend(eos if isinstance(eos, list) else [eos])
    try:
        fields = dict(
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
            # for Llama the flag also puts a bias on o_proj, which the shape check then reports as unsupported
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=unique_ids(eos_ids),
            hidden_act=hidden_act,
            attn_logit_softcap=positive_or_none(optional("attn_logit_softcapping")),
            final_logit_softcap=positive_or_none(optional("final_logit_softcapping")),
            local_rope_theta=local_theta,
        )
        return ModelArchConfig(architecture=architecture, **(fields | family.hf_fields(hf)))
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
