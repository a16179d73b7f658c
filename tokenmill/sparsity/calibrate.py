"""Calibrating activation-sparsity thresholds (TEAL): run the model over calibration text and
record, for every decoder layer, the distribution of the magnitudes of its four linear inputs
(q/k/v, o, gate/up, down: layers/sparsity.py); the threshold for sparsity s is that
distribution's s-quantile.

The model is the checkpoint's, dense (a GGUF file's quantized tensors dequantized) in the
given dtype, built with PyTorch's ops only, as `tokenmill quantize` calibrates: its own prefill
forwards over whole windows with a scratch KV cache (quantization/calibration.py), every token
counted. The magnitudes go into fixed log2-spaced histograms (BINS_PER_OCTAVE bins per octave from
2^LOG2_MIN to 2^LOG2_MAX; smaller magnitudes and zeros in the first bin), so memory does not grow
with the calibration data; a quantile is interpolated within its bin (in log2), an error far below
the sampling noise of the data.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tokenmill.layers.sparsity import LINEAR_INPUTS

_log = logging.getLogger(__name__)

LOG2_MIN, LOG2_MAX, BINS_PER_OCTAVE = -32, 16, 64
NUM_BINS = (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE


class MagnitudeHistogram:
    """Counts of |x| over every entry of every x added, in log2-spaced bins."""

    def __init__(self):
        self.counts = torch.zeros(NUM_BINS, dtype=torch.float64)
        self.total = 0

    def add(self, x: torch.Tensor) -> None:
        logs = x.detach().float().abs().log2().clamp_(LOG2_MIN, LOG2_MAX)  # zeros: -inf, into the first bin
        self.counts += torch.histc(logs, NUM_BINS, LOG2_MIN, LOG2_MAX).double().cpu()
        self.total += x.numel()

    def quantile(self, share: float) -> float:
        """The magnitude below which `share` of the entries lie (0 for share 0)."""
        if share <= 0 or self.total == 0:
            return 0.0
        cumulative = self.counts.cumsum(0)
        target = share * float(cumulative[-1])
        b = min(int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64))[0]), NUM_BINS - 1)
        before = float(cumulative[b - 1]) if b else 0.0
        inside = (target - before) / float(self.counts[b]) if self.counts[b] > 0 else 0.0
        return 2.0 ** (LOG2_MIN + (b + min(max(inside, 0.0), 1.0)) / BINS_PER_OCTAVE)

    def share_below(self, threshold: float) -> float:
        """The share of entries whose magnitude is below `threshold`, read from the bins
        (interpolated within the bin it falls in)."""
        if threshold <= 0 or self.total == 0:
            return 0.0
        position = (min(max(torch.tensor(threshold).log2().item(), LOG2_MIN), LOG2_MAX) - LOG2_MIN) * BINS_PER_OCTAVE
        b = min(int(position), NUM_BINS - 1)
        below = float(self.counts[:b].sum()) + (position - b) * float(self.counts[b])
        return below / float(self.counts.sum())


def layer_inputs(model) -> list[dict[str, torch.nn.Module]]:
    """Per decoder layer, the linear whose input each LINEAR_INPUTS entry is."""
    return [dict(zip(LINEAR_INPUTS, (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                     layer.mlp.down_proj)))
            for layer in model.layers]


@torch.inference_mode()
def collect_histograms(model, sequences: list[list[int]], batch_tokens: int = 2048) -> list[dict[str, MagnitudeHistogram]]:
    """The magnitude histograms of every decoder layer's linear inputs over `sequences` (a
    `models.base.CausalLM` with plain nn.Linear layers and no experts)."""
    from tokenmill.quantization.calibration import prefill_forward, token_batches

    if model.config.num_experts:
        raise ValueError("activation sparsity: not for mixtures of experts")
    histograms = [{name: MagnitudeHistogram() for name in LINEAR_INPUTS} for _ in model.layers]
    hooks = [linear.register_forward_pre_hook(lambda _m, args, h=histograms[i][name]: h.add(args[0]))
             for i, linears in enumerate(layer_inputs(model)) for name, linear in linears.items()]
    try:
        for batch in token_batches(sequences, batch_tokens):
            prefill_forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return histograms


def thresholds_from(histograms: list[dict[str, MagnitudeHistogram]], sparsities) -> list[dict[str, list[float]]]:
    """The `layers` record of a thresholds file: per layer and input, one threshold per sparsity."""
    return [{name: [float(f"{h[name].quantile(s):.6g}") for s in sparsities] for name in LINEAR_INPUTS}
            for h in histograms]


@torch.no_grad()
def load_dense_model(source: Path, dtype: torch.dtype, max_position: int):
    """(checkpoint, model): the checkpoint at `source` in `dtype` with PyTorch's ops, dense (a
    checkpoint written by `tokenmill quantize` as stored, its layers without the compiled kernels)."""
    from tokenmill.models import build_model
    from tokenmill.models.loader import load_checkpoint

    checkpoint = load_checkpoint(source)
    if checkpoint.quantization is not None:
        from tokenmill.models.streaming import load_streaming
        from tokenmill.quantization.quantize import quant_config_from_checkpoint

        qconfig = quant_config_from_checkpoint(checkpoint.quantization)
        model = load_streaming(checkpoint, lambda on: build_model(checkpoint, max_position, dtype, device=on),
                               torch.device("cpu"), dtype, qconfig, quantized=dict(checkpoint.weights()))
    else:
        model = build_model(checkpoint, max_position, dtype)
        model.load_weights(checkpoint.weights())
    return checkpoint, model.to(dtype=dtype).eval()


def calibrate(source: Path, output: Path | None, calibration: str = "gsm8k", num_sequences: int = 100,
              seq_len: int = 512, dtype: torch.dtype = torch.float32, seed: int = 0,
              exclude_gsm8k: set[int] = frozenset()) -> Path:
    """Calibrate the thresholds of the checkpoint at `source` on `num_sequences` windows of
    `seq_len` tokens of `calibration` (quantization/calibration.py's sources) and write them to
    `output` (None: thresholds.default_path). Returns the path written."""
    from tokenmill.quantization.calibration import calibration_sequences, calibration_texts
    from tokenmill.sparsity.thresholds import SPARSITY_GRID, default_path, model_identity, write_thresholds

    t0 = time.perf_counter()
    checkpoint, model = load_dense_model(source, dtype, seq_len)
    texts = calibration_texts(calibration, exclude_gsm8k)
    sequences = calibration_sequences(texts, checkpoint.tokenizer, num_sequences, seq_len, seed)
    histograms = collect_histograms(model, sequences)
    identity = model_identity(source, checkpoint.config)
    path = Path(output) if output is not None else default_path(identity)
    num_tokens = sum(map(len, sequences))
    write_thresholds(path, identity, {"source": calibration, "sequences": len(sequences), "seq_len": seq_len,
                                      "tokens": num_tokens, "dtype": str(dtype).removeprefix("torch."), "seed": seed},
                     list(SPARSITY_GRID), thresholds_from(histograms, SPARSITY_GRID))
    _log.info("activation sparsity: %d layers calibrated on %d tokens in %.1f s", len(histograms), num_tokens,
              time.perf_counter() - t0)
    return path
