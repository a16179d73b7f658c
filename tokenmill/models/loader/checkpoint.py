"""What every format's reader returns (`LoadedCheckpoint`) and raises (`ModelLoadError`), and the
checks and helpers the readers share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.models.loader.arch import ModelArchConfig, expected_weight_shapes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


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
        method there instead (layers/quantization/formats.py): "int4", the file's own codes (types of
        models.gguf_blocks.INT4_REPACKED, group size 32); "int6", the file's own codes and scales
        (Q6_K); "int8", requantized per output channel a block of rows at a time (no float32 copy
        of the whole tensor).

        Tensors are read (and dequantized) lazily, each a fresh tensor the caller owns. Names are
        exactly those of `expected_weight_shapes(self.config)`, each once; `lm_head.weight` only
        when the head is untied. May be called again for a second pass.
        """
        return self._read_weights(dict(records or {}))


def check_tensor_shapes(source: Path, config: ModelArchConfig, found: dict[str, tuple[int, ...]]) -> None:
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


def unique_ids(ids: list[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def positive_or_none(value: Any) -> float | None:
    return float(value) if value else None
