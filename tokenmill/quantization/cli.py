"""`tokenmill quantize MODEL --method M [--algorithm A] [--calibration DATA] -o DIR`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tokenmill.config import (
    INT4_GROUP_SIZES, LM_HEAD_CHOICES, QUANTIZATION_ALGORITHMS, QUANTIZATION_METHODS, EngineConfig,
)

_log = logging.getLogger(__name__)
_D = EngineConfig()


def add_calibration_args(parser) -> None:
    """The calibration flags, the same for `tokenmill quantize` and for quantizing on load."""
    parser.add_argument("--calibration", default=_D.calibration,
                        help="calibration data for awq/gptq/smoothquant: gsm8k (test problems with worked solutions, "
                             "minus the accuracy report's sample), gpl3, or a .txt / .jsonl ('text' field) file "
                             f"(default: {_D.calibration})")
    parser.add_argument("--calibration-samples", type=int, default=_D.calibration_samples,
                        help=f"calibration windows (default: {_D.calibration_samples})")
    parser.add_argument("--calibration-seq-len", type=int, default=_D.calibration_seq_len,
                        help=f"tokens per calibration window (default: {_D.calibration_seq_len})")
    parser.add_argument("--smoothquant-alpha", type=float, default=_D.smoothquant_alpha,
                        help="smoothquant migration strength in [0, 1] (default: searched per layer)")


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's linear layers (calibrated or round-to-nearest), save the "
                                        "checkpoint and write an accuracy report next to it",
                       description="Writes DIR (config.json, tokenizer, model.safetensors) that `tokenmill serve DIR` "
                                   "and LLM(DIR) load, then measures the original and the quantized model side by side "
                                   "(GPL-3 perplexity, GSM8K exact match, size, decode tok/s) into "
                                   "DIR/accuracy_report.{md,json}.")
    p.add_argument("model", help="model alias, .gguf file or Hugging Face directory")
    p.add_argument("-o", "--output", required=True, help="directory to write the quantized checkpoint to")
    p.add_argument("--method", required=True, choices=QUANTIZATION_METHODS,
                   help="int8: weight-only, per output channel; int4: weight-only, asymmetric groups; w8a8: int8 weights "
                        "and per-token int8 activations; fp8: E4M3 weights (and activations on FP8 GPUs)")
    p.add_argument("--algorithm", default="rtn", choices=tuple(QUANTIZATION_ALGORITHMS),
                   help="rtn: round-to-nearest (no data); awq: activation-aware scales + clipping (int4); gptq: "
                        "Hessian-based error compensation (int4); smoothquant: activation outliers moved into the "
                        "weights (w8a8) (default: rtn)")
    p.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES, default=_D.quantization_group_size,
                   help="int4: input channels per scale/zero group; a layer it does not divide takes the largest of "
                        f"64, 32 that does (default: {_D.quantization_group_size})")
    p.add_argument("--lm-head", choices=LM_HEAD_CHOICES, default=_D.quantization_lm_head,
                   help="the LM head's format: int8 (weight-only, per output channel; what auto gives), int4 "
                        "(weight-only, groups of --group-size, round-to-nearest) or none (dense, --save-dtype) "
                        "(default: auto)")
    add_calibration_args(p)
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the tensors left unquantized (embeddings, norms) in the checkpoint (default: bfloat16)")
    p.add_argument("--no-report", dest="report", action="store_false", help="only write the checkpoint")
    p.add_argument("--report-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype of both models in the report (default: auto)")
    p.add_argument("--gsm8k-problems", type=int, default=100,
                   help="GSM8K problems in the report, 0 = skip (default: 100)")
    p.add_argument("--gsm8k-max-tokens", type=int, default=256, help="answer length limit in the report (default: 256)")
    p.add_argument("--ppl-max-windows", type=int, default=None,
                   help="score only the first N 512-token windows of GPL-3 in the report (default: all)")
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import resolve_model
    from tokenmill.quantization.quantize import QuantConfig, quantize_checkpoint
    from tokenmill.quantization.report import ReportSettings, disk_bytes, measure, write_report

    # Through the engine config, whose checks name the bad field (method/algorithm pairs, ranges).
    qconfig = QuantConfig.from_engine(EngineConfig(
        quantization=args.method, quantization_group_size=args.group_size, quantization_algorithm=args.algorithm,
        quantization_lm_head=args.lm_head,
        calibration=args.calibration, calibration_samples=args.calibration_samples,
        calibration_seq_len=args.calibration_seq_len, smoothquant_alpha=args.smoothquant_alpha))
    source = resolve_model(args.model)
    checkpoint = load_checkpoint(source)
    if checkpoint.quantization is not None:
        raise ValueError(f"{source} is already quantized ({checkpoint.quantization.get('method')})")
    settings = ReportSettings(dtype=args.report_dtype, ppl_max_windows=args.ppl_max_windows,
                              gsm8k_problems=args.gsm8k_problems if args.report else 0, gsm8k_max_tokens=args.gsm8k_max_tokens)
    problems, exclude = report_problems(settings.gsm8k_problems)

    out = Path(args.output)
    seconds = quantize_checkpoint(checkpoint, qconfig, out, getattr(torch, args.save_dtype), exclude)
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MB) in {seconds:.1f} s")
    if not args.report:
        return 0

    label = f"{args.method} {args.algorithm}" + (f" g{args.group_size}" if args.method == "int4" else "")
    rows = [
        # the original's weights dense (a GGUF file's quantized tensors dequantized, as quantize reads them)
        measure(f"original ({source.name})", str(source), disk_bytes(source), settings, problems, quantization="none"),
        measure(label, str(out), disk_bytes(out), settings, problems),
    ]
    header = {"source": str(source), "method": label, "dtype": settings.dtype, "gsm8k_problems": len(problems),
              "gsm8k_max_tokens": settings.gsm8k_max_tokens, "ppl_windows": settings.ppl_max_windows or "all",
              "calibration": None if args.algorithm == "rtn" else
              f"{args.calibration}, {args.calibration_samples} x {args.calibration_seq_len} tokens"}
    print(write_report(out, header, rows))
    return 0


def report_problems(num_problems: int):
    """The report's GSM8K sample, and its test-set indices (calibration must not see them)."""
    if num_problems <= 0:
        return [], set()
    from tokenmill.eval.gsm8k import load_gsm8k

    problems = load_gsm8k(num_problems)
    return problems, {p.index for p in problems}
