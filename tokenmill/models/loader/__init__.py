"""Reading a checkpoint (a GGUF file or a Hugging Face directory) into one common form.

Whatever the format, a `LoadedCheckpoint` offers the same three things: a `ModelArchConfig`, a
tokenizer, and the weights under Hugging Face's Llama/Qwen2 names, in float32 and PyTorch's
`[out, in]` layout. Model code never sees GGUF names, quantized blocks or llama.cpp's q/k row
order. Everything that can be checked without reading tensor data (architecture, config,
tensor names and shapes, tokenizer) is checked in `load_checkpoint`, so a bad file fails there
with a `ModelLoadError` that names it, not halfway through building a model.

What a family opens (its config.json model_types and defaults, GGUF architecture names, fields
beyond Llama's, checkpoint tensor names) is declared on its class (models/base.py: `CausalLM`) and
read here through the registry (models/__init__.py: MODEL_CLASSES); the loaders hold no per-family
tables.

The package: `arch.py` (the architecture, `ModelArchConfig`, and the weights it implies),
`checkpoint.py` (`LoadedCheckpoint`, `ModelLoadError`), `gguf_loader.py` (GGUF files, their
tokenizer included) and `hf_loader.py` (Hugging Face directories).
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.models.loader.arch import (
    HIDDEN_ACTIVATIONS, LAYER_TYPES, ROPE_TYPES, ModelArchConfig, expected_weight_shapes, supported_architectures,
)
from tokenmill.models.loader.checkpoint import LoadedCheckpoint, ModelLoadError
from tokenmill.models.loader.gguf_loader import load_gguf
from tokenmill.models.loader.hf_loader import arch_config_from_dict, arch_config_from_hf, load_hf_dir

__all__ = [
    "HIDDEN_ACTIVATIONS", "LAYER_TYPES", "ROPE_TYPES", "LoadedCheckpoint", "ModelArchConfig", "ModelLoadError",
    "arch_config_from_dict", "arch_config_from_hf", "expected_weight_shapes", "load_checkpoint",
    "supported_architectures",
]


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Open a `.gguf` file or a Hugging Face directory (see `registry.resolve_model`)."""
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model directory")
