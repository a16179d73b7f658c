"""The KV cache's format and tensors: the dtype its codes are stored in (and whether they are
quantized, with a float32 scale per token and head), the combinations of model dtype, attention
backend and GPU that cannot use it (refused as a `ConfigError` on `kv_cache_dtype`), each
layer's cache tensors in the layouts of `layers.attention.backend`, the bytes a token's K and V
take, and the identity of a block's bytes (what besides its tokens decides them: the disk tier's
files are kept under it).

How many blocks the device cache, the swap pool and the prefix cache's host tier get is the
runner's to decide (`worker/memory.py` has the arithmetic on CUDA).
"""

from __future__ import annotations

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.layers.attention.kv_quant import KV_CODE_DTYPES, KV_STORE_DTYPES
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.models.registry import resolve_model
from tokenmill.worker.disk_store import cache_identity

KVCaches = list[tuple[torch.Tensor, ...]]  # per layer: (key, value) or (key codes, value codes, key scales, value scales)


def kv_cache_format(kv_cache_dtype: str, dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """The dtype of the cache's codes and whether they are quantized: the compute dtype (auto),
    float16 under a float32 model, or int8 / fp8 with a float32 scale per token and head."""
    code_dtype = {**KV_CODE_DTYPES, **KV_STORE_DTYPES}.get(kv_cache_dtype, dtype)
    if kv_cache_dtype in KV_STORE_DTYPES and dtype != torch.float32:
        raise ConfigError("kv_cache_dtype", f"{kv_cache_dtype} stores a float32 model's keys and values in "
                          f"half the bytes; this model computes in {str(dtype).removeprefix('torch.')} "
                          "(use auto, int8 or fp8)")
    return code_dtype, kv_cache_dtype in KV_CODE_DTYPES


def check_backend_reads(kv_cache_dtype: str, attention_backend: str, device: torch.device) -> None:
    """Refuse a cache dtype the attention backend (or, for fp8 with Triton, the GPU) cannot read."""
    if attention_backend == "triton" and kv_cache_dtype in KV_STORE_DTYPES:
        raise ConfigError("kv_cache_dtype", f"{kv_cache_dtype} is read by the torch attention backend and "
                          "the CPU kernels; with the triton backend use auto, int8 or fp8")
    if (device.type == "cuda" and attention_backend == "triton" and kv_cache_dtype == "fp8"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ConfigError("kv_cache_dtype", "fp8 with the triton attention backend needs a GPU of compute "
                          "capability 8.9+ (Ada, Hopper; Triton has no e4m3 type below); use int8, or "
                          "--attention-backend torch")


def make_caches(arch, num_blocks: int, block_size: int, code_dtype: torch.dtype, quantized: bool, device,
                host_pool: bool = False, pin: bool = False) -> KVCaches:
    """Per layer (key, value) caches, or (key codes, value codes, key scales, value scales)
    when quantized: the layouts of `layers.attention.backend`. The device cache is zeroed
    (padded attention reads unwritten slots, masked); a host pool, whose blocks are always
    written before they are read, is left uninitialized and costs no memory until used (pin:
    pinned, for fast copies to and from CUDA)."""
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    specs = [(shape, code_dtype)] * 2 + ([(shape[:-1], torch.float32)] * 2 if quantized else [])
    make = torch.empty if host_pool else torch.zeros
    return [
        tuple(make(s, dtype=dt, device=device, pin_memory=pin) for s, dt in specs)
        for _ in range(arch.num_hidden_layers)
    ]


def kv_bytes_per_token(archs: list, code_dtype: torch.dtype, quantized: bool) -> int:
    """The K and V of one token in every layer of the models of `archs`, with the scales of a
    quantized cache (one float32 per KV head)."""
    scale_bytes = 4 if quantized else 0
    return sum(
        2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim * code_dtype.itemsize + scale_bytes)
        for c in archs
    )


def block_identity(config: EngineConfig, checkpoint: LoadedCheckpoint, dtype: torch.dtype, code_dtype: torch.dtype,
                   host_caches: KVCaches, archs: list) -> bytes:
    """What decides a KV block's bytes besides its tokens (worker/disk_store.py): the
    model's files and shape, the draft model's, precision, quantization, KV-cache dtype and
    layout, block size. archs: the target's and the draft model's configs; host_caches: the
    host tier's layer caches (their layout)."""
    from tokenmill.sparsity.thresholds import model_identity

    fields = {
        "model": model_identity(checkpoint.source, checkpoint.config)["fingerprint"],
        "draft_model": config.draft_model and str(resolve_model(config.draft_model)),
        "dtype": str(dtype), "kv_cache_dtype": config.kv_cache_dtype, "kv_code_dtype": str(code_dtype),
        "block_size": config.block_size,
        "layout": [[list(t.shape[1:]), str(t.dtype)] for t in (host_caches[0] if host_caches else ())],
        "layers": [(a.num_hidden_layers, a.num_key_value_heads, a.head_dim) for a in archs],
        "quantization": [config.quantization, config.quantization_group_size, config.quantization_lm_head,
                         config.quantization_algorithm, config.calibration, config.calibration_samples,
                         config.calibration_seq_len, config.smoothquant_alpha],
        "activation_sparsity": [config.activation_sparsity, config.activation_sparsity_prefill,
                                config.activation_sparsity_file],
    }
    return cache_identity(fields)
