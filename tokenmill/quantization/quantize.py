"""Quantizing a model's linear layers, and the quantized checkpoint format.

Every method is a module swap: each `nn.Linear` of the model is replaced by the layer of its
method (`tokenmill.layers.linear`), built from a record of tensors
(`tokenmill.layers.quantization.formats`). Round-to-nearest makes the record from the weight
alone; the calibrated algorithms from the weight and the statistics of that layer's inputs on
calibration data, layer after layer with the earlier ones already quantized
(`calibration.quantize_sequentially`). The model code never branches on any of it.

A quantized checkpoint (written by `tokenmill quantize`, read by `load_checkpoint`) is a
directory: `config.json` (the architecture in Hugging Face's keys plus a `quantization_config`
with `quant_method: "tokenmill"`, the method, group size, algorithm and calibration), the
tokenizer files, and `model.safetensors` holding the model's own parameter names for
everything that is not a linear layer and `<linear>.<key>` for each record's tensors (and bias).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.layers.linear import build_linear
from tokenmill.layers.quantization.formats import AUTO, LM_HEAD, ROUTER_SUFFIXES, record_from_rtn
from tokenmill.quantization import calibration

if TYPE_CHECKING:
    from tokenmill.models.loader import LoadedCheckpoint

_log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class QuantConfig:
    method: str  # QUANTIZATION_METHODS
    group_size: int = 32
    algorithm: str = "rtn"  # QUANTIZATION_ALGORITHMS
    lm_head: str | None = "int8"  # the LM head's own method (None: the dtype's weights)
    calibration: str = "gsm8k"
    calibration_samples: int = 64
    calibration_seq_len: int = 512
    smoothquant_alpha: float | None = None

    @classmethod
    def from_engine(cls, config: EngineConfig, checkpoint: LoadedCheckpoint | None = None) -> QuantConfig | None:
        """The engine's quantization of `checkpoint`: None for dense weights (and for a checkpoint
        that is quantized already, loaded as stored); method AUTO for a GGUF file's quantized
        tensors as stored."""
        if config.quantization in (None, "none"):
            return None
        head = None if config.quantization_lm_head == "none" else config.quantization_lm_head
        if config.quantization == AUTO:
            if checkpoint and checkpoint.stored_types:  # lm_head AUTO: the file's head as stored
                return cls(method=AUTO, group_size=config.quantization_group_size, lm_head=head)
            if head != AUTO:
                raise ConfigError("quantization_lm_head", f"applies to a GGUF file's head under quantization 'auto'; "
                                  f"{checkpoint.source if checkpoint else 'this checkpoint'} is loaded as stored")
            return None
        return cls(
            method=config.quantization, group_size=config.quantization_group_size, algorithm=config.quantization_algorithm,
            lm_head="int8" if head == AUTO else head,
            calibration=config.calibration, calibration_samples=config.calibration_samples,
            calibration_seq_len=config.calibration_seq_len, smoothquant_alpha=config.smoothquant_alpha,
        )

    def method_of(self, linear_name: str) -> str | None:
        """The method of linear `linear_name`; None keeps it dense: a mixture of experts' router
        and shared-expert gate (a few rows each, whose rounding would change which experts run)."""
        if linear_name.endswith(ROUTER_SUFFIXES):
            return None
        return self.lm_head if linear_name == LM_HEAD else self.method


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(model: nn.Module, qconfig: QuantConfig, tokenizer=None,
                   exclude_gsm8k: set[int] = frozenset()) -> dict[str, dict[str, torch.Tensor]]:
    """Swap every nn.Linear of `model` (loaded, on its device; fp32 for the best records) that
    has a method for its quantized layer, calibrating first when the algorithm needs it (then
    `tokenizer` is required). Returns the records by linear name (what a checkpoint stores).
    The quantized layers keep their records as they are when the model is later cast to the
    compute dtype (only their bias follows). The layers are built without the compiled CPU kernels
    (calibration runs the layers quantized so far): quantized_tensors hands the records to a
    model built for running."""
    names = linear_names(model)
    records = {}

    def quantize(name: str, stats) -> None:
        linear, method = model.get_submodule(name), qconfig.method_of(name)
        bias = None if linear.bias is None else linear.bias.detach()
        record = _record(method, qconfig, linear.weight.detach(), stats)
        records[name] = {k: v.to(linear.weight.device) for k, v in record.items()}
        _replace(model, name, build_linear(method, records[name], bias))

    t0 = time.perf_counter()
    if qconfig.algorithm != "rtn":
        texts = calibration.calibration_texts(qconfig.calibration, exclude_gsm8k)
        sequences = calibration.calibration_sequences(texts, tokenizer, qconfig.calibration_samples, qconfig.calibration_seq_len)
        calibrated = [n for n in names if qconfig.method_of(n) == qconfig.method and n != LM_HEAD]
        calibration.quantize_sequentially(model, sequences, calibrated, quantize)
        _log.info("calibrated %d linear layers (%s) on %d windows of %d tokens from %s in %.1f s", len(calibrated),
                  qconfig.algorithm, len(sequences), qconfig.calibration_seq_len, qconfig.calibration, time.perf_counter() - t0)
    for name in names:
        if name not in records and qconfig.method_of(name) is not None:  # else it stays an nn.Linear
            quantize(name, None)
    _log.info("quantized %d linear layers (%s, %s) in %.1f s", len(records), qconfig.method, qconfig.algorithm, time.perf_counter() - t0)
    return records


def _record(method: str, qconfig: QuantConfig, weight: torch.Tensor, stats) -> dict[str, torch.Tensor]:
    if stats is None or qconfig.algorithm == "rtn":
        return record_from_rtn(method, weight, qconfig.group_size)
    if qconfig.algorithm == "awq":
        from tokenmill.quantization.awq import awq_int4

        return awq_int4(weight, stats, qconfig.group_size)
    if qconfig.algorithm == "gptq":
        from tokenmill.quantization.gptq import gptq_int4

        return gptq_int4(weight, stats, qconfig.group_size)
    if qconfig.algorithm == "smoothquant":
        from tokenmill.quantization.smoothquant import smoothquant_w8a8

        return smoothquant_w8a8(weight, stats, qconfig.smoothquant_alpha)
    raise ValueError(f"unknown quantization algorithm {qconfig.algorithm!r}")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


# --- checkpoint ---------------------------------------------------------------------------

def quantize_checkpoint(checkpoint, qconfig: QuantConfig, directory: Path, save_dtype: torch.dtype = torch.bfloat16,
                        exclude_gsm8k: set[int] = frozenset()) -> float:
    """Quantize a loaded (unquantized) checkpoint on the CPU in fp32 and write it to `directory`
    (`save_quantized`); the tensors left dense are stored in `save_dtype`. Returns the seconds taken."""
    t0 = time.perf_counter()
    tensors = quantized_tensors(checkpoint, qconfig, torch.device("cpu"), save_dtype, exclude_gsm8k)
    extra = {} if qconfig.algorithm == "rtn" else {"quantize_seconds": round(time.perf_counter() - t0, 1)}
    save_quantized(directory, tensors, qconfig, checkpoint, extra)
    return time.perf_counter() - t0


def quantized_tensors(checkpoint, qconfig: QuantConfig, device: torch.device, dense_dtype: torch.dtype,
                      exclude_gsm8k: set[int] = frozenset()) -> dict[str, torch.Tensor]:
    """A quantized checkpoint's tensors by name (what `models.streaming.load_streaming` reads as
    `quantized`), on the CPU: the linears' records and biases, everything else in `dense_dtype`.
    Quantized from the fp32 weights, calibrated on `device` with PyTorch's ops only (no compiled
    kernels), so the records are the same wherever and however the model later runs."""
    from tokenmill.models import build_model

    model = build_model(checkpoint, qconfig.calibration_seq_len, torch.float32)
    model.load_weights(checkpoint.weights())
    model.to(device=device).eval()
    linears = {n for n in linear_names(model) if qconfig.method_of(n) is not None}
    tensors = {n: p.detach().to(device="cpu", dtype=dense_dtype, copy=True).contiguous()
               for n, p in model.named_parameters() if n.rpartition(".")[0] not in linears}
    biases = {n: model.get_submodule(n).bias.detach().cpu().float().contiguous()
              for n in linears if model.get_submodule(n).bias is not None}
    records = quantize_model(model, qconfig, checkpoint.tokenizer, exclude_gsm8k=exclude_gsm8k)
    for linear, record in records.items():
        for key, t in record.items():
            tensors[f"{linear}.{key}"] = t.detach().cpu().contiguous()
        if linear in biases:
            tensors[f"{linear}.bias"] = biases[linear]
    return tensors


def save_quantized(directory: Path, tensors: dict[str, torch.Tensor], qconfig: QuantConfig, checkpoint,
                   extra: dict | None = None) -> None:
    """Write a quantized checkpoint: `tensors` (quantized_tensors), its config and tokenizer."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = _hf_config_dict(checkpoint.config)
    config["quantization_config"] = {
        "quant_method": "tokenmill", "format_version": FORMAT_VERSION, **dataclasses.asdict(qconfig),
        "source": str(checkpoint.source), **(extra or {}),
    }
    if qconfig.algorithm == "rtn":
        for key in ("calibration", "calibration_samples", "calibration_seq_len", "smoothquant_alpha"):
            config["quantization_config"].pop(key)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    checkpoint.tokenizer.save_pretrained(str(directory))


def _hf_config_dict(arch) -> dict:
    from tokenmill.models import MODEL_CLASSES

    family = MODEL_CLASSES[arch.architecture]
    return {
        # the family's config.json model_type, and its class, named as transformers names it
        "model_type": next(iter(family.hf_model_types)),
        "architectures": [family.__name__],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": list(arch.eos_token_ids),
        # Every field of the family, read back as it is (models/loader/hf_loader.py: arch_config_from_dict).
        "tokenmill_arch": dataclasses.asdict(arch),
    }


def quant_config_from_checkpoint(raw: dict) -> QuantConfig:
    fields = {f.name for f in dataclasses.fields(QuantConfig)}
    return QuantConfig(**{k: v for k, v in raw.items() if k in fields})

