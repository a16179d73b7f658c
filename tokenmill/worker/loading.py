"""Loading the model runner's models: the target's or a draft model's weights (streamed onto the
device: as the checkpoint stores them, quantized by round-to-nearest on the way, or the
records of a quantized checkpoint or of a calibrated method computed here), the draft model's
checkpoint (checked against the target's vocabulary and context), and activation sparsity's
thresholds file (read, and checked against the checkpoint, before the weights load).

What is done with the loaded models (activation sparsity enabled on the target, the weights
gathered on a CPU, the compiled decoder) is the runner's start-up.
"""

from __future__ import annotations

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed import ParallelGroup, ShardPlan
from tokenmill.models import build_model
from tokenmill.models.loader import LoadedCheckpoint, load_checkpoint
from tokenmill.models.registry import resolve_model
from tokenmill.models.streaming import load_streaming
from tokenmill.quantization.quantize import QuantConfig, quant_config_from_checkpoint, quantized_tensors


def load_model(checkpoint: LoadedCheckpoint, config: EngineConfig, max_model_len: int, device: torch.device,
               dtype: torch.dtype, attention_backend: str, cpu_kernels, parallel: ParallelGroup | None,
               shard: ShardPlan | None):
    """The checkpoint's model on `device`, in eval mode, streamed tensor by tensor (models/streaming.py):
    unquantized, or quantized round-to-nearest on the way; or from the quantized tensors of a
    checkpoint `tokenmill quantize` wrote, or of a calibrated method computed here."""
    qconfig = QuantConfig.from_engine(config, checkpoint)

    def build(on: str = "cpu"):
        return build_model(checkpoint, max_model_len, dtype, attention_backend, cpu_kernels, on, parallel, shard)

    if checkpoint.quantization is None and (qconfig is None or qconfig.algorithm == "rtn"):
        return load_streaming(checkpoint, build, device, dtype, qconfig, cpu_kernels, shard)
    # (refused before any rank starts: executor/multiproc.py, EngineConfig's quantization_algorithm)
    assert parallel is None, "a model split over ranks loads dense, GGUF or round-to-nearest weights"
    if checkpoint.quantization is not None:  # written by `tokenmill quantize`
        if qconfig is not None:
            raise ConfigError("quantization", f"{checkpoint.source} is already quantized "
                              f"({checkpoint.quantization.get('method')}); leave quantization auto")
        tensors, qconfig = dict(checkpoint.weights()), quant_config_from_checkpoint(checkpoint.quantization)
    else:
        # Exactly the tensors `tokenmill quantize` writes (quantized from the fp32 weights,
        # calibrated in fp32 with PyTorch's ops), then loaded as a saved checkpoint is.
        tensors = quantized_tensors(checkpoint, qconfig, device, torch.float32)
    return load_streaming(checkpoint, build, device, dtype, qconfig, cpu_kernels, quantized=tensors)


def draft_checkpoint(config: EngineConfig, target: LoadedCheckpoint, max_model_len: int) -> LoadedCheckpoint:
    """config.draft_model's checkpoint, which must share the target's vocabulary and hold a
    context of max_model_len."""
    draft = load_checkpoint(resolve_model(config.draft_model))
    if draft.config.vocab_size != target.config.vocab_size or draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError(
            "draft_model",
            f"{draft.source.name} does not share the vocabulary of {target.source.name} "
            f"({draft.config.vocab_size} vs {target.config.vocab_size} token ids, or different tokens)",
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ConfigError("draft_model", f"{draft.source.name} has a context of {draft.config.max_position_embeddings} "
                          f"tokens, less than max_model_len {max_model_len}")
    return draft


def activation_thresholds(config: EngineConfig, checkpoint: LoadedCheckpoint):
    """The thresholds table for config.activation_sparsity (models/base.py:
    enable_activation_sparsity), from the model's thresholds file (sparsity/thresholds.py), which
    must have been calibrated for this checkpoint: a `ThresholdTable`."""
    from tokenmill.sparsity.thresholds import find_thresholds, load_thresholds, model_identity

    identity = model_identity(checkpoint.source, checkpoint.config)
    return load_thresholds(find_thresholds(checkpoint.source, identity, config.activation_sparsity_file), identity)
