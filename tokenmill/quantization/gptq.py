"""GPTQ (Frantar et al. 2022): quantize one input column at a time and push its rounding error
onto the columns not yet quantized, weighted by the inverse calibration Hessian, so later
columns compensate for earlier ones (Optimal Brain Surgeon, one column at a time).

Columns are taken in decreasing order of H's diagonal ("act order": the inputs with the largest
activations first, while the most columns remain to absorb their error), which matters on models
with outlier channels. Group-wise asymmetric int4 keeps its groups of consecutive input
channels (the kernel's layout): each group's scale and min are fixed up front from the weights
("static groups"). Columns are processed in blocks of 128, with the error applied to later
blocks once per block (the paper's lazy batch update). Dead inputs (never non-zero in
calibration) are zeroed. Dampening: 0.1 x the mean diagonal is added to H (the paper uses
0.01); on SmolLM2-135M with GSM8K calibration, 0.1 gave lower output error on held-out GPL-3
activations in all 6 layers measured (e.g. 0.42x vs 0.53x round-to-nearest's error on a qkv
projection), the Hessian of a few thousand tokens being a noisy estimate.
"""

from __future__ import annotations

import torch

from tokenmill.layers.quantization.formats import int4_codes, int4_group_params, layer_group_size, pack_int4
from tokenmill.quantization.calibration import LinearStats


def gptq_int4(weight: torch.Tensor, stats: LinearStats, group_size: int, damp: float = 0.1, block: int = 128,
              act_order: bool = True) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    group_size = layer_group_size(k, group_size)
    w = weight.float().cpu().clone()
    h = stats.hessian.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    scales, mins = int4_group_params(w.view(n, k // group_size, group_size))  # [N, groups]
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    group_of = perm // group_size  # group of each column in processing order
    w, h = w[:, perm], h[perm][:, perm]
    h += torch.eye(k, dtype=h.dtype) * damp * torch.diag(h).mean()
    # Upper Cholesky factor of H⁻¹: row i holds the update weights of column i's error.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    codes = torch.empty(n, k, dtype=torch.int32)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].clone()
        err = torch.empty_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            g = group_of[b0 + i]
            q = int4_codes(wb[:, i : i + 1], scales[:, g], mins[:, g])[:, 0]
            codes[:, b0 + i] = q.to(torch.int32)
            e = (wb[:, i] - (q * scales[:, g] + mins[:, g])) / hb[i, i]
            wb[:, i:].addr_(e, hb[i, i:], alpha=-1)
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    unpermuted = torch.empty_like(codes)
    unpermuted[:, perm] = codes
    return {"codes": pack_int4(unpermuted), "scales": scales, "mins": mins}
