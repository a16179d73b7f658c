"""SmoothQuant (Xiao et al. 2022) for W8A8: activations have a few outlier channels that ruin
per-token int8; weights do not. Dividing input channel j of the activations by
s_j = max|x_j|^α / max|w_j|^(1-α) and multiplying weight column j by it moves the outliers
into the weights, where per-output-channel int8 absorbs them.

α is searched per layer on a grid that includes 0 (no smoothing), minimizing the squared
output error of the fully quantized matmul (weights per channel, activations per token) on the
calibration sample rows, against the full-precision output.
"""

from __future__ import annotations

import torch

from tokenmill.layers.quantization.formats import quantize_int8, quantize_rows_int8
from tokenmill.quantization.calibration import LinearStats

ALPHA_GRID = tuple(i / 10 for i in range(10))


def smoothquant_w8a8(weight: torch.Tensor, stats: LinearStats, alpha: float | None = None) -> dict[str, torch.Tensor]:
    """Record of a W8A8 layer; `alpha` None = searched on ALPHA_GRID."""
    w = weight.float().cpu()
    x = stats.samples
    ref = x @ w.t()
    a_max = stats.abs_max.clamp(min=1e-5)
    w_max = w.abs().amax(dim=0).clamp(min=1e-5)
    best = None
    for a in ALPHA_GRID if alpha is None else (alpha,):
        s = (a_max.pow(a) / w_max.pow(1 - a)).clamp(min=1e-5)
        codes, scales = quantize_int8(w * s)
        xq, xs = quantize_rows_int8(x / s)
        err = float(((xq.float() @ codes.float().t()) * xs * scales - ref).pow(2).mean())
        if best is None or err < best[0]:
            best = (err, a, s, codes, scales)
    _, _, s, codes, scales = best
    return {"codes": codes, "scales": scales, "input_scale": 1 / s}
