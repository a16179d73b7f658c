"""Model implementations by architecture (one file per family over models/base.py's `CausalLM`),
and building one from a loaded checkpoint. MODEL_CLASSES is also what the loaders open: each
class declares the checkpoints it answers to (models/base.py), read by models/loader/."""

from __future__ import annotations

import torch

from tokenmill.layers.attention import make_backend
from tokenmill.models.base import CausalLM
from tokenmill.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.phi3 import Phi3ForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM, Qwen3ForCausalLM
from tokenmill.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# ModelArchConfig.architecture -> the family's model class. A new family: its file, and its line here.
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def _check_registry() -> None:
    """One class per architecture, and no checkpoint that two families answer to (a GGUF name
    two share must tell them apart by their experts: models/loader/gguf_loader.py)."""
    classes = list(MODEL_CLASSES.values())
    assert len(set(classes)) == len(classes), "a class serves two architectures"
    hf_types = [name for cls in classes for name in cls.hf_model_types]
    assert len(set(hf_types)) == len(hf_types), f"a config.json model_type answered twice: {sorted(hf_types)}"
    gguf = [(name, cls.has_experts) for cls in classes for name in cls.gguf_architectures]
    assert len(set(gguf)) == len(gguf), f"a GGUF architecture answered twice: {sorted(gguf)}"


_check_registry()


def build_model(checkpoint: LoadedCheckpoint, max_position: int, dtype: torch.dtype,
                attention_backend: str = "torch", cpu_kernels=None, device: str = "cpu", parallel=None,
                shard=None) -> CausalLM:
    """The checkpoint's model class on `device` with plain nn.Linear layers, weights not loaded
    (`load_weights`; on the meta device, `models.streaming.load_streaming` fills it),
    attending with the backend named `attention_backend` (`layers.attention.make_backend`);
    `cpu_kernels` (the module of `layers.cpu_kernels.load()`, for a model that runs on the CPU)
    serves its norms and the torch backend's decode attention. parallel, shard: this rank's
    `distributed.ParallelGroup` and `ShardPlan` when the model is split over ranks (the model is
    then the rank's part)."""
    arch = checkpoint.config
    model_cls = MODEL_CLASSES.get(arch.architecture)
    if model_cls is None:
        raise ValueError(f"{checkpoint.source}: no model implementation for architecture {arch.architecture!r}")
    with torch.device(device):  # "meta": no memory, no random init (models.streaming fills it)
        return model_cls(arch if shard is None else shard.local_config(), make_backend(attention_backend, cpu_kernels),
                         max_position, dtype, cpu_kernels, parallel, shard)
