"""Model implementations by architecture, and building one from a loaded checkpoint."""

from __future__ import annotations

import torch

from tokenmill.layers.attention import make_backend
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import LoadedCheckpoint

from tokenmill.models.loader import SUPPORTED_ARCHITECTURES

# Every family runs the one configurable decoder (models/llama.py).
MODEL_CLASSES = dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM)


def build_model(checkpoint: LoadedCheckpoint, max_position: int, dtype: torch.dtype,
                attention_backend: str = "torch", cpu_kernels=None, device: str = "cpu", parallel=None,
                shard=None) -> LlamaForCausalLM:
    """The checkpoint's model class on the CPU with plain nn.Linear layers, weights not loaded
    (`load_weights`, or `quantization.quantize.load_quantized_weights` for a quantized checkpoint),
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
