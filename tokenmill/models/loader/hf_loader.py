"""A Hugging Face model directory as a `LoadedCheckpoint`: config.json (and
generation_config.json) as a `ModelArchConfig` with the defaults transformers uses, the
safetensors files (sharded or not) read lazily, and the directory's tokenizer. A directory
`tokenmill quantize` wrote carries its config as it was and its quantized records as stored."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.loader.arch import HIDDEN_ACTIVATIONS, ROPE_TYPES, SUPPORTED_ARCHITECTURES, ModelArchConfig
from tokenmill.models.loader.checkpoint import (
    LoadedCheckpoint, ModelLoadError, check_tensor_shapes, positive_or_none, unique_ids,
)

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


def load_hf_dir(directory: Path) -> LoadedCheckpoint:
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
            eos_token_ids=unique_ids(eos_ids),
            hidden_act=hidden_act,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embedding_multiplier=hidden_size**0.5 if gemma else 1.0,
            attention_scale=float(get("query_pre_attn_scalar")) ** -0.5 if gemma else None,
            attn_logit_softcap=positive_or_none(optional("attn_logit_softcapping")),
            final_logit_softcap=positive_or_none(optional("final_logit_softcapping")),
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
