"""Attention over the paged KV cache. `TorchAttentionBackend` is the portable reference."""

from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata, DecodeGroup, TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "TorchAttentionBackend"]
