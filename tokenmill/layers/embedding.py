"""An embedding table kept in int4 (`Int4Embedding`): a GGUF file's Q4_0 / Q4_1 / Q4_K token
embedding as it is stored (models/gguf_blocks.py), a quarter of bf16's memory. A step reads only
its tokens' rows, so each lookup dequantizes just those."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.formats import dequantize_record


class Int4Embedding(nn.Module):
    """`nn.Embedding` over an int4 record (codes uint8 [V, H/2], scales and mins float32
    [V, H/g]): forward(ids) gives the rows' w = code * scale + min, in `dtype`."""

    def __init__(self, record: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.codes, self.scales, self.mins = record["codes"], record["scales"], record["mins"]
        self.num_embeddings, self.embedding_dim = self.codes.shape[0], self.codes.shape[1] * 2
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = {"codes": self.codes[ids], "scales": self.scales[ids], "mins": self.mins[ids]}
        return dequantize_record("int4", rows).to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 groups of {self.embedding_dim // self.scales.shape[1]}"
