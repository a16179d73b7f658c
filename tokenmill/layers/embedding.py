"""An embedding table kept quantized (`QuantizedEmbedding`): a GGUF file's Q4_0 / Q4_1 / Q4_K token
embedding as an int4 record, or a tied Q6_K one as an int6 record (models/gguf_blocks.py), as it is
stored: a quarter of bf16's memory or less. A step reads only its tokens' rows, so each lookup
dequantizes just those."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.formats import dequantize_record

class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over an int4 record (codes uint8 [V, H/2], scales and mins float32 [V, H/g])
    or an int6 one (codes uint8 [V, H], scales float32 [V, H/16]): forward(ids) gives the rows'
    weights, in `dtype`."""

    def __init__(self, record: dict[str, torch.Tensor], method: str, dtype: torch.dtype):
        super().__init__()
        self.method = method
        self.codes, self.scales = record["codes"], record["scales"]
        self.mins = record["mins"] if method == "int4" else None
        self.num_embeddings, self.embedding_dim = self.codes.shape[0], self.codes.shape[1] * (2 if method == "int4" else 1)
        self.group_size = self.embedding_dim // self.scales.shape[1]
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = {"codes": self.codes[ids], "scales": self.scales[ids]}
        if self.mins is not None:
            rows["mins"] = self.mins[ids]
        return dequantize_record(self.method, rows).to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.method} groups of {self.group_size}"
