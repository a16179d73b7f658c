"""`tokenmill calibrate-sparsity MODEL [--sequences N] [--output FILE]` (the standard library and
the engine flags' module until the command runs)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenmill.engine_args import positive_int


def add_calibrate_sparsity_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate-sparsity",
        help="calibrate the per-layer thresholds of --activation-sparsity (TEAL) for a model",
        description="Runs MODEL (dense, PyTorch ops) over calibration text, records the magnitudes of every decoder "
                    "layer's linear inputs (q/k/v share one input, gate/up one, o_proj and down_proj one each) in "
                    "histograms, and writes a small JSON file with, per layer and input, the magnitude below which "
                    "0%, 5%, ..., 95% of the entries fell. `--activation-sparsity S` (serve, generate, eval, "
                    "LLM(activation_sparsity=S)) then zeroes, on decode steps, the entries of each input below its "
                    "threshold for S (interpolated between those points). The file records the model's shape and a "
                    "fingerprint of its files; the engine refuses it for any other model. By default it is written "
                    "under ~/.cache/tokenmill/sparsity/, where the engine finds it; a file beside the model "
                    "(X.gguf.sparsity.json, or DIR/activation_sparsity.json) is found too.")
    p.add_argument("model", help="model alias, .gguf file or Hugging Face directory")
    p.add_argument("--sequences", type=positive_int, default=100, metavar="N",
                   help="calibration windows (fewer when the text is short) (default: 100)")
    p.add_argument("--seq-len", type=positive_int, default=512, metavar="TOKENS", help="tokens per calibration window (default: 512)")
    p.add_argument("--calibration", default="gsm8k",
                   help="calibration text: gsm8k (test problems with worked solutions, minus the few-shot examples "
                        "and the first --exclude-gsm8k problems of the evaluation sample), gpl3 (the text GPL-3 "
                        "perplexity is measured on), or a .txt / .jsonl ('text' field) file (default: gsm8k)")
    p.add_argument("--exclude-gsm8k", type=int, default=100, metavar="N",
                   help="gsm8k: leave out the first N problems of `tokenmill eval gsm8k`'s sample, so that an "
                        "evaluation of up to N problems is on text calibration never saw (default: 100)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of the calibration forwards (default: float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of windows (default: 0)")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="where to write the thresholds (default: ~/.cache/tokenmill/sparsity/<model>-<fingerprint>.json, "
                        "where the engine looks)")
    p.set_defaults(func=run_calibrate_sparsity)


def run_calibrate_sparsity(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.models.registry import resolve_model
    from tokenmill.sparsity.calibrate import calibrate

    exclude = set()
    if args.calibration == "gsm8k" and args.exclude_gsm8k > 0:
        from tokenmill.eval.gsm8k import load_gsm8k

        exclude = {p.index for p in load_gsm8k(args.exclude_gsm8k)}
    source = resolve_model(args.model)
    start = time.perf_counter()
    path = calibrate(source, args.output, args.calibration, args.sequences, args.seq_len, getattr(torch, args.dtype),
                     args.seed, exclude)
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    return 0
