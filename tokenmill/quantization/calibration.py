"""Calibration: what the linear layers of a model see on real text.

`calibration_sequences` turns a data source (GSM8K problems with their worked answers, GPL-3,
or a user's text file) into fixed-length token windows, deterministically. `collect_stats` runs
the model over them — its own prefill forwards with a scratch KV cache, no engine — and records,
for every linear layer's input x (rows = tokens), what the calibrated methods need:

- `hessian` = mean of x xᵀ [K, K]: the output error of a weight change ΔW over the calibration
  tokens is tr(ΔW H ΔWᵀ), so AWQ's scale search and GPTQ work from H alone;
- `abs_mean`, `abs_max` per input channel (AWQ's activation salience, SmoothQuant's outlier range);
- `samples`: a fixed random subset of rows, for searches that quantize the activations
  themselves (SmoothQuant's α).

Two ways to collect them:

- `collect_stats`: every layer sees what it sees in the unquantized model (one forward per share
  of layers; the Hessians of all layers may not fit in memory for a large model — a 1.5B model
  needs ~9 GB in fp32 — so they are collected `max_stats_gb` at a time).
- `quantize_sequentially`: what quantization uses. Decoder layer by decoder layer, and inside a
  layer linear by linear in forward order, each linear's statistics are taken with every linear
  before it already quantized, and it is quantized at once: a layer's calibration compensates
  for the error its inputs already carry (GPTQ's "true sequential" order). The hidden states
  at the current layer's input are kept for all calibration tokens, so the cost is about two
  forwards of the model, not one per layer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenmill.eval.perplexity import GPL3_PATH
from tokenmill.layers.attention import BatchLayout

_log = logging.getLogger(__name__)

CALIBRATION_SOURCES = ("gsm8k", "gpl3")  # or a path to a .txt / .jsonl file


@dataclass
class LinearStats:
    hessian: torch.Tensor  # [K, K] fp32, mean of x xᵀ over calibration tokens
    abs_mean: torch.Tensor  # [K]
    abs_max: torch.Tensor  # [K]
    samples: torch.Tensor  # [<= sample_rows, K] fp32
    num_rows: int


def calibration_texts(source: str, exclude_gsm8k: set[int] = frozenset()) -> list[str]:
    """The documents of a calibration source. gsm8k: test-set problems with their worked
    solutions, except the evaluation few-shot examples and the indices in `exclude_gsm8k` (the
    sample an accuracy report evaluates)."""
    if source == "gsm8k":
        from tokenmill.eval.gsm8k import fewshot_examples, load_all_problems

        problems = load_all_problems()
        exclude = set(exclude_gsm8k) | {p.index for p in fewshot_examples(problems)}
        return [f"{p.question}\n{p.solution}\nThe answer is {p.answer}." for p in problems if p.index not in exclude]
    if source == "gpl3":
        if not GPL3_PATH.is_file():
            raise ValueError(f"calibration: {GPL3_PATH} not found (Debian's common-licenses package has it)")
        return [GPL3_PATH.read_text()]
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"calibration: {source!r} is neither one of {', '.join(CALIBRATION_SOURCES)} nor a file")
    if path.suffix == ".jsonl":
        docs = []
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                docs.append(record["text"] if isinstance(record, dict) else str(record))
        return docs
    return [path.read_text()]


def calibration_sequences(texts: list[str], tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """`num_samples` windows of `seq_len` tokens cut from the documents joined end to end,
    chosen with a seeded generator (fewer when the text is short)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not windows:
        raise ValueError(f"calibration: {len(ids)} tokens of text, not enough for one window of {seq_len}")
    if len(windows) < num_samples:
        _log.warning("calibration: only %d windows of %d tokens (asked for %d)", len(windows), seq_len, num_samples)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    return [windows[i] for i in sorted(order[:num_samples].tolist())]


class _Accumulator:
    def __init__(self, in_features: int, sample_rows_per_batch: int, generator: torch.Generator):
        k = in_features
        self.xtx = torch.zeros(k, k, dtype=torch.float64)
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.abs_max = torch.zeros(k)
        self.samples: list[torch.Tensor] = []
        self.rows = 0
        self.per_batch = sample_rows_per_batch
        self.generator = generator

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        self.xtx += (x.t() @ x).double()
        self.abs_sum += x.abs().sum(0).double()
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(0))
        self.rows += x.shape[0]
        pick = torch.randperm(x.shape[0], generator=self.generator)[: self.per_batch]
        self.samples.append(x[pick.sort().values])

    def stats(self) -> LinearStats:
        n = max(self.rows, 1)
        return LinearStats((self.xtx / n).float(), (self.abs_sum / n).float(), self.abs_max, torch.cat(self.samples), self.rows)


@torch.inference_mode()
def collect_stats(model: nn.Module, sequences: list[list[int]], names: list[str], sample_rows: int = 512,
                  batch_tokens: int = 2048, max_stats_gb: float = 2.0) -> dict[str, LinearStats]:
    """Statistics of the inputs of the `nn.Linear` modules `names` of `model` (a
    `models.base.CausalLM` with plain nn.Linear layers) over `sequences`."""
    modules = dict(model.named_modules())
    cost = {name: modules[name].in_features ** 2 * 8 for name in names}  # fp64 x xᵀ
    shares: list[list[str]] = [[]]
    for name in names:
        if shares[-1] and sum(cost[n] for n in shares[-1]) + cost[name] > max_stats_gb * 2**30:
            shares.append([])
        shares[-1].append(name)
    batches = token_batches(sequences, batch_tokens)
    stats: dict[str, LinearStats] = {}
    for i, share in enumerate(shares):
        if len(shares) > 1:
            _log.info("calibration pass %d of %d (%d linear layers)", i + 1, len(shares), len(share))
        generator = torch.Generator().manual_seed(i)
        per_batch = math.ceil(sample_rows / len(batches))
        accs = {name: _Accumulator(modules[name].in_features, per_batch, generator) for name in share}
        hooks = [modules[name].register_forward_pre_hook(lambda _m, args, acc=accs[name]: acc.add(args[0])) for name in share]
        try:
            for batch in batches:
                prefill_forward(model, batch)
        finally:
            for hook in hooks:
                hook.remove()
        for name, acc in accs.items():
            stats[name] = acc.stats()
            stats[name].samples = stats[name].samples[:sample_rows]
    return stats


class _StopForward(Exception):
    """Raised by a statistics hook: the rest of the layer's forward is not needed."""


class _Batch:
    """One batch of calibration sequences as the decoder layers see it: the hidden states at the
    current layer's input, the rotary rows, the attention metadata and a one-layer scratch cache."""

    def __init__(self, model: nn.Module, sequences: list[list[int]], block_size: int = 16):
        input_ids, positions, self.meta, caches = _scratch_prefill(model, sequences, block_size, 1)
        self.cache = caches[0]
        self.cos_sins = model.rope_rows(positions)
        self.x = model.embed(input_ids)  # as CausalLM.forward begins

    def run(self, layer: nn.Module) -> torch.Tensor:
        return layer(self.cos_sins, self.x, self.cache, self.meta)


@torch.inference_mode()
def quantize_sequentially(model: nn.Module, sequences: list[list[int]], names: list[str],
                          quantize: Callable[[str, LinearStats], None], sample_rows: int = 512,
                          batch_tokens: int = 2048) -> None:
    """Calibrate and quantize the linears `names` of `model` (a `models.base.CausalLM`) in forward
    order: `quantize(name, stats)` must swap the linear `name` for its quantized layer; the
    statistics of every later linear are then taken through it (see the module docstring).
    A decoder layer's linears are taken in their registration order, which is their forward
    order in `LlamaDecoderLayer`."""
    wanted = set(names)
    missed = wanted - {f"layers.{i}.{n}" for i, layer in enumerate(model.layers) for n, _ in layer.named_modules()}
    if missed:  # before any forward: the walk below would pass over them
        raise ValueError(f"quantize_sequentially: not linear layers of the decoder layers: {sorted(missed)[:4]}")
    batches = [_Batch(model, b) for b in token_batches(sequences, batch_tokens)]
    per_batch = math.ceil(sample_rows / len(batches))
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}."
        for local, module in [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]:
            name = prefix + local
            if name not in wanted:
                continue
            acc = _Accumulator(module.in_features, per_batch, torch.Generator().manual_seed(len(wanted) + index))

            def hook(_m, args, acc=acc):
                acc.add(args[0])
                raise _StopForward

            handle = module.register_forward_pre_hook(hook)
            try:
                for batch in batches:
                    try:
                        batch.run(layer)
                    except _StopForward:
                        pass
            finally:
                handle.remove()
            stats = acc.stats()
            stats.samples = stats.samples[:sample_rows]
            quantize(name, stats)
        for batch in batches:
            batch.x = batch.run(layer)


def token_batches(sequences: list[list[int]], batch_tokens: int) -> list[list[list[int]]]:
    """`sequences` in order, in batches of at most `batch_tokens` tokens (a longer sequence alone)."""
    batches: list[list[list[int]]] = [[]]
    for seq in sequences:
        if batches[-1] and sum(map(len, batches[-1])) + len(seq) > batch_tokens:
            batches.append([])
        batches[-1].append(seq)
    return batches


def prefill_forward(model: nn.Module, sequences: list[list[int]], block_size: int = 16) -> None:
    """One forward over whole sequences, each attending only to itself (a scratch KV cache)."""
    input_ids, positions, meta, caches = _scratch_prefill(model, sequences, block_size, model.config.num_hidden_layers)
    model(input_ids, positions, caches, meta)


def _scratch_prefill(model: nn.Module, sequences: list[list[int]], block_size: int, num_caches: int):
    """The inputs of a prefill of whole `sequences`, each in consecutive blocks of its own:
    (input_ids, positions, attention metadata, `num_caches` scratch (key, value) caches)."""
    config = model.config
    param = next(model.parameters())
    lengths = [len(s) for s in sequences]
    tables, slots = [], []
    for n in lengths:
        first = sum(len(t) for t in tables)
        tables.append(list(range(first, first + math.ceil(n / block_size))))
        slots.extend(range(first * block_size, first * block_size + n))
    num_blocks = sum(len(t) for t in tables)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = [(torch.empty(shape, dtype=param.dtype, device=param.device), torch.empty(shape, dtype=param.dtype, device=param.device))
              for _ in range(num_caches)]
    input_ids = torch.tensor([t for s in sequences for t in s], device=param.device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(param.device)
    meta = model.attn_backend.build_metadata(BatchLayout(block_size, slots, [], [], lengths, lengths, tables), param.device)
    return input_ids, positions, meta, caches
