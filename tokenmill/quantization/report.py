"""The accuracy report of a quantized checkpoint: the original and the quantized model side by
side, each served by a fresh engine in this process — perplexity on GPL-3 (the protocol of the
core tests), greedy exact match on a fixed GSM8K sample, size on disk and in memory, and decode
tokens/s at batch 1 and 32. Written as JSON and Markdown next to the checkpoint, and printed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.sampling_params import SamplingParams

THROUGHPUT_BATCHES = (1, 32)
THROUGHPUT_TOKENS = 64


@dataclass
class ReportRow:
    name: str
    perplexity: float
    gsm8k_accuracy: float | None
    gsm8k_correct: int | None
    disk_mb: float
    memory_mb: float  # the model's weights as held by the engine
    decode_tok_s: dict[int, float]  # batch size -> output tokens/s
    seconds: float  # how long this row took to measure
    kv_bytes_per_token: int = 0  # of the KV cache, all layers (its capacity per GiB follows)
    gsm8k_predictions: list[str | None] | None = None  # per problem, normalized (None: no number)


@dataclass
class ReportSettings:
    dtype: str = "auto"
    ppl_max_windows: int | None = None  # None = all of GPL-3
    gsm8k_problems: int = 100  # 0 = skip
    gsm8k_max_tokens: int = 256


def measure(name: str, model: str, disk_bytes: int, settings: ReportSettings, problems, **engine) -> ReportRow:
    """One row: `model` served by a fresh engine (`engine`: more LLM keyword arguments)."""
    from tokenmill import LLM
    from tokenmill.eval.gsm8k import evaluate_gsm8k
    from tokenmill.eval.perplexity import gpl3_perplexity

    t0 = time.perf_counter()
    llm = LLM(model, dtype=settings.dtype, max_num_seqs=max(THROUGHPUT_BATCHES + (len(problems),)), **engine)
    ppl = gpl3_perplexity(llm, max_windows=settings.ppl_max_windows)
    gsm = evaluate_gsm8k(llm, problems, max_tokens=settings.gsm8k_max_tokens) if problems else None
    speed = {b: decode_speed(llm, b) for b in THROUGHPUT_BATCHES}
    row = ReportRow(
        name=name, perplexity=ppl,
        gsm8k_accuracy=None if gsm is None else gsm.accuracy, gsm8k_correct=None if gsm is None else gsm.num_correct,
        disk_mb=disk_bytes / 2**20, memory_mb=model_bytes(llm.engine.core.runner.model) / 2**20,
        decode_tok_s=speed, seconds=time.perf_counter() - t0, kv_bytes_per_token=llm.engine.core.runner.kv_bytes_per_token(),
        gsm8k_predictions=None if gsm is None else [r.predicted for r in gsm.records],
    )
    del llm
    gc.collect()
    return row


def decode_speed(llm, batch: int) -> float:
    """Output tokens/s of `batch` requests of THROUGHPUT_TOKENS tokens each (short distinct
    prompts, ignore_eos), all submitted at once."""
    prompts = [f"Item {i}: write one sentence about the number {i}." for i in range(batch)]
    params = SamplingParams(max_tokens=THROUGHPUT_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def disk_bytes(path: Path) -> int:
    """Size on disk of a model: the file, or every file of a directory."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor a module holds (parameters, buffers and the plain tensor attributes
    of the quantized layers), each counted once."""
    seen, total = set(), 0
    for module in model.modules():
        for value in list(module.__dict__.get("_parameters", {}).values()) + list(module.__dict__.get("_buffers", {}).values()) + list(vars(module).values()):
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    return total


def gsm8k_agreement(row: ReportRow, base: ReportRow) -> float | None:
    """The share of GSM8K problems on which `row` predicts the same number as `base` (at a
    model's accuracy floor, a finer signal of change than the exact-match count)."""
    if row.gsm8k_predictions is None or base.gsm8k_predictions is None:
        return None
    pairs = list(zip(row.gsm8k_predictions, base.gsm8k_predictions, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs)


def write_report(directory: Path, header: dict, rows: list[ReportRow]) -> str:
    """Write accuracy_report.json and accuracy_report.md into `directory`; return the Markdown."""
    base = rows[0]
    lines = [f"# Accuracy report: {header['method']}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| model | GPL-3 ppl | vs original | GSM8K exact match | same GSM8K answer as original | disk MB | memory MB | "
              + " | ".join(f"tok/s batch {b}" for b in THROUGHPUT_BATCHES) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(THROUGHPUT_BATCHES)]
    for row in rows:
        change = f"{(row.perplexity / base.perplexity - 1) * 100:+.2f}%"
        gsm = "–" if row.gsm8k_accuracy is None else f"{row.gsm8k_correct}/{header['gsm8k_problems']} ({row.gsm8k_accuracy:.1%})"
        agree = gsm8k_agreement(row, base)
        speeds = " | ".join(f"{row.decode_tok_s[b]:.1f}" for b in THROUGHPUT_BATCHES)
        lines.append(f"| {row.name} | {row.perplexity:.3f} | {change} | {gsm} | {'–' if agree is None else f'{agree:.0%}'} "
                     f"| {row.disk_mb:.1f} | {row.memory_mb:.1f} | {speeds} |")
    markdown = "\n".join(lines) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "accuracy_report.md").write_text(markdown)
    (directory / "accuracy_report.json").write_text(json.dumps(
        {**header, "rows": [dataclasses.asdict(r) for r in rows],
         "perplexity_change": rows[-1].perplexity / base.perplexity - 1}, indent=2) + "\n")
    return markdown
