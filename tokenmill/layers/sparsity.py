"""Activation sparsity (TEAL, training-free): a linear's input with its small-magnitude entries
set to zero, by one threshold per decoder layer and input (tokenmill/sparsity/ calibrates them).

A decoder layer's linears have four inputs: q/k/v share one (the input norm's output), as gate
and up do (the post-attention norm's output); o_proj and down_proj each have their own. Only the
first `rows` rows of a step's flat batch are thresholded: the decodes, which the runner puts
first (prefill stays dense), or every row when the engine sparsifies prefill too.
csrc/cpu_decoder.cpp runs the same ops, so the compiled DecoderStack stays bit-identical to the
Python layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A layer's linear inputs, in the order of a thresholds row ([num_layers, 4]) and of the file's keys.
LINEAR_INPUTS = ("qkv", "o", "gate_up", "down")
QKV, O, GATE_UP, DOWN = range(len(LINEAR_INPUTS))


def sparsify(x: torch.Tensor, threshold: torch.Tensor, rows: int) -> torch.Tensor:
    """x [num_tokens, features] with the entries of its first `rows` rows whose magnitude is below
    `threshold` (a 0-dim tensor, compared in x's dtype) set to zero; x itself when `rows` is 0."""
    if rows == 0:
        return x
    if rows >= x.shape[0]:
        return x.masked_fill(x.abs() < threshold, 0)
    head = x[:rows]
    return torch.cat((head.masked_fill(head.abs() < threshold, 0), x[rows:]))


@dataclass(frozen=True, slots=True)
class SparseInputs:
    """One decoder layer's share of a step's activation sparsity."""

    thresholds: torch.Tensor  # [4] float32, the layer's thresholds in LINEAR_INPUTS order
    rows: int  # the step's first `rows` tokens are thresholded (>= 1)

    def __call__(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return sparsify(x, self.thresholds[which], self.rows)
