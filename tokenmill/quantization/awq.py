"""Activation-aware int4 (AWQ, Lin et al. 2023), with the output error measured through the
calibration Hessian instead of re-running the layer.

Input channels that carry large activations matter most. Scaling weight column j up by s_j
(and the activation down by the same factor, `input_scale` = 1/s) gives those columns a finer
share of their group's 16 levels. s = mean|x|^α, normalized; α is searched on a grid per layer,
minimizing tr(ΔW H ΔWᵀ), the squared output error over the calibration tokens. α = 0 is plain
round-to-nearest, so the search never does worse than it on the calibration data. Then each
group's range is clipped (min and max shrunk by a searched ratio), minimizing the same error
restricted to the group (the block-diagonal part of H): outliers no longer stretch the grid.
"""

from __future__ import annotations

import torch

from tokenmill.quantization.calibration import LinearStats
from tokenmill.quantization.formats import int4_codes, int4_group_params, layer_group_size, pack_int4


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ): the mean squared output change (summed over outputs) of a weight change ΔW."""
    return float(((delta @ hessian) * delta).sum())


def awq_int4(weight: torch.Tensor, stats: LinearStats, group_size: int, grid: int = 20,
             clip_ratios: tuple[float, ...] = tuple(1 - 0.05 * i for i in range(10))) -> dict[str, torch.Tensor]:
    group_size = layer_group_size(weight.shape[1], group_size)
    w = weight.float().cpu()
    s = awq_scale(w, stats, group_size, grid)
    codes, scales, mins = clip_search_int4(w * s, group_size, stats.hessian / s[:, None] / s[None, :], clip_ratios)
    return {"codes": pack_int4(codes), "scales": scales, "mins": mins, "input_scale": 1 / s}


def awq_scale(w: torch.Tensor, stats: LinearStats, group_size: int, grid: int = 20) -> torch.Tensor:
    """The per-input-channel scale s = mean|x|^α (normalized) whose round-to-nearest int4 of
    W·diag(s) has the least output error, α on a grid of grid + 1 points in [0, 1]."""
    h = stats.hessian
    salience = stats.abs_mean.clamp(min=1e-6)
    best_err, best_scale = float("inf"), torch.ones(w.shape[1])
    for i in range(grid + 1):
        s = salience.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(_fake_quant(w * s, group_size) / s - w, h)
        if err < best_err:
            best_err, best_scale = err, s
    return best_scale


def _fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    scales, mins = int4_group_params(g)
    return (int4_codes(g, scales, mins) * scales[..., None] + mins[..., None]).view(n, k)


def clip_search_int4(w: torch.Tensor, group_size: int, hessian: torch.Tensor, ratios: tuple[float, ...]):
    """Group-wise int4 of `w` [N, K] whose range per (row, group) is [min, max] × the ratio with
    the least error d H_gg dᵀ (H_gg: the group's diagonal block of `hessian`, the Hessian of
    the inputs `w` sees). Returns (codes int32 [N, K], scales, mins)."""
    n, k = w.shape
    groups = k // group_size
    g = w.view(n, groups, group_size)
    blocks = torch.stack([hessian[j * group_size : (j + 1) * group_size, j * group_size : (j + 1) * group_size] for j in range(groups)])
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    best_err = torch.full((n, groups), float("inf"))
    best_scales, best_mins = torch.empty(n, groups), torch.empty(n, groups)
    for r in ratios:
        scales = ((hi - lo) * r / 15).clamp(min=1e-12)
        mins = lo * r
        d = int4_codes(g, scales, mins) * scales[..., None] + mins[..., None] - g
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scales = torch.where(better, scales, best_scales)
        best_mins = torch.where(better, mins, best_mins)
    return int4_codes(g, best_scales, best_mins).to(torch.int32).view(n, k), best_scales, best_mins
