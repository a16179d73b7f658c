#!/usr/bin/env python
"""Accuracy of activation sparsity (TEAL, `--activation-sparsity S`) at several S, against S = 0.

Per sparsity S:
- perplexity of GPL-3 or `--ppl-text` (llama.cpp's protocol, `tokenmill eval ppl`'s machinery)
  with every token of every window sparsified (`activation_sparsity_prefill=True`): the scored second half of each
  window, and the first half it attends to too. Served, a prompt stays dense and only generated
  tokens are sparsified, so this bounds the loss from above (the context's keys and values carry
  the thresholds' error as well), rather than sparsifying only the scored tokens;
- optionally GSM8K greedy exact match (`tokenmill eval gsm8k`'s machinery) on `--gsm8k-problems`
  problems as served: prompts dense, every generated token sparsified; with the share of problems
  answered with the same number as at S = 0.

The thresholds are the model's file (`tokenmill calibrate-sparsity`; `--thresholds`, else the one
the engine finds); when there is none, this script calibrates one first (`--calibrate-sequences`
windows of GSM8K minus the first 100 problems of the evaluated sample, written where the engine
looks). Accuracy only: sparsity does not yet make a step faster.

    python benchmarks/activation_sparsity.py                                 # S = 0, 0.25, 0.4, 0.5
    python benchmarks/activation_sparsity.py --gsm8k-problems 0 --ppl-max-windows 4
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

from common import RESULTS_DIR, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "activation_sparsity.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--sparsities", default="0,0.25,0.4,0.5", help="comma-separated targets in [0, 0.95]; 0 is the reference")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="compute dtype")
    p.add_argument("--quantization", default="auto", help="the engine's --quantization")
    p.add_argument("--thresholds", type=Path, default=None, help="thresholds file (default: the one the engine finds)")
    p.add_argument("--calibrate-sequences", type=int, default=100,
                   help="windows of 512 tokens to calibrate on when the model has no thresholds file yet")
    p.add_argument("--ppl-text", type=Path, default=None,
                   help="score this text file instead of GPL-3 (which a model trained on web text may know "
                        "nearly by heart)")
    p.add_argument("--ppl-max-windows", type=int, default=None, help="score only the first N 512-token windows of the text")
    p.add_argument("--gsm8k-problems", type=int, default=100, help="GSM8K problems per sparsity, 0 = skip")
    p.add_argument("--gsm8k-max-tokens", type=int, default=256, help="answer length limit")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON report")
    args = p.parse_args(argv)
    try:
        args.sparsities = [float(s) for s in args.sparsities.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sparsities: expected comma-separated numbers, got {args.sparsities!r}")
    if 0.0 not in args.sparsities:
        args.sparsities.insert(0, 0.0)
    return args


def thresholds_file(args) -> Path:
    """The thresholds the engine will read, calibrated first when the model has none."""
    from tokenmill.config import ConfigError
    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import resolve_model
    from tokenmill.sparsity.calibrate import calibrate
    from tokenmill.sparsity.thresholds import find_thresholds, model_identity

    if args.thresholds is not None:
        return args.thresholds
    source = resolve_model(args.model)
    identity = model_identity(source, load_checkpoint(source).config)
    try:
        return find_thresholds(source, identity)
    except ConfigError:
        from tokenmill.eval.gsm8k import load_gsm8k

        print(f"no thresholds for {source.name}: calibrating on {args.calibrate_sequences} windows", flush=True)
        exclude = {p.index for p in load_gsm8k(100)}
        return calibrate(source, None, "gsm8k", args.calibrate_sequences, exclude_gsm8k=exclude)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from tokenmill import LLM
    from tokenmill.eval.gsm8k import evaluate_gsm8k, load_gsm8k
    from tokenmill.eval.perplexity import GPL3_PATH, gpl3_perplexity

    path = thresholds_file(args)
    text = args.ppl_text or GPL3_PATH
    problems = load_gsm8k(args.gsm8k_problems) if args.gsm8k_problems > 0 else []
    engine = {"dtype": args.dtype, "quantization": args.quantization, "activation_sparsity_file": str(path)}
    rows: dict[float, dict] = {}
    for s in args.sparsities:
        start = time.perf_counter()
        llm = LLM(args.model, activation_sparsity=s, activation_sparsity_prefill=s > 0, **engine)
        row = {"sparsity": s, "perplexity": gpl3_perplexity(llm, max_windows=args.ppl_max_windows, path=text)}
        del llm
        gc.collect()
        if problems:
            llm = LLM(args.model, activation_sparsity=s, **engine)
            result = evaluate_gsm8k(llm, problems, max_tokens=args.gsm8k_max_tokens)
            row.update(gsm8k_correct=result.num_correct, gsm8k_accuracy=result.accuracy,
                       gsm8k_predictions=[r.predicted for r in result.records],
                       gsm8k_output_tokens=result.num_output_tokens)
            del llm
            gc.collect()
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows[s] = row
        print(f"S={s:g}: ppl {row['perplexity']:.3f}"
              + (f", GSM8K {row['gsm8k_correct']}/{len(problems)}" if problems else "") + f" ({row['seconds']:.0f} s)",
              flush=True)

    base = rows[0.0]
    table = []
    for row in rows.values():
        row["ppl_change_pct"] = (row["perplexity"] / base["perplexity"] - 1) * 100
        if problems:
            pairs = zip(row["gsm8k_predictions"], base["gsm8k_predictions"], strict=True)
            row["gsm8k_same_answer"] = sum(a == b for a, b in pairs) / len(problems)
        table.append([f"{row['sparsity']:.0%}", f"{row['perplexity']:.3f}", f"{row['ppl_change_pct']:+.2f}%",
                      f"{row['gsm8k_correct']}/{len(problems)}" if problems else "-",
                      f"{row['gsm8k_same_answer']:.0%}" if problems else "-"])
    print()
    print_table(["sparsity", f"{text.name} ppl (all tokens sparse)", "vs dense", "GSM8K", "same answer"], table)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["thresholds"] = str(path)
    write_report(args.output, "activation_sparsity", config, list(rows.values()),
                 gsm8k_problem_indices=[p.index for p in problems], ppl_text=str(text),
                 calibration=json.loads(path.read_text())["calibration"])


if __name__ == "__main__":
    main()
