"""Attention over the paged KV cache. `TorchAttentionBackend` is the portable reference;
`make_backend("triton")` gives the Triton kernels' backend (CUDA, or Triton's CPU interpreter)."""

from tokenmill.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    DecodeGroup,
    TorchAttentionBackend,
    build_decode_groups,
    prefill_kernel_takes,
    split_by_length,
)

ATTENTION_BACKENDS = ("torch", "triton")


def make_backend(name: str, cpu_kernels=None) -> AttentionBackend:
    """The attention backend called `name` (one of ATTENTION_BACKENDS); Triton is imported only here.
    The torch backend runs decodes (and bf16 prefills) through `cpu_kernels` when given."""
    if name == "torch":
        return TorchAttentionBackend(kernels=cpu_kernels)
    if name == "triton":
        from tokenmill.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; known: {ATTENTION_BACKENDS}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "BatchLayout",
    "DecodeGroup",
    "TorchAttentionBackend",
    "build_decode_groups",
    "make_backend",
    "prefill_kernel_takes",
    "split_by_length",
]
