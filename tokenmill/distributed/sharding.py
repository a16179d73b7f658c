"""Which part of the model one rank holds, and cutting checkpoint tensors down to it.

Tensor parallelism (Megatron's split): q/k/v and gate/up are column-parallel (each rank computes
its heads and its slice of the intermediate size), o and down are row-parallel (each rank's
partial sums are all-reduced once per sublayer), the embedding and the LM head are split by
vocabulary rows. Ranks take contiguous ranges of KV heads with their query heads; with fewer KV
heads than ranks each KV head is replicated on tp / kv_heads ranks, which split its query heads.
Ranges need not be equal (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so the KV cache of each
rank holds its own heads.

Pipeline parallelism: each stage holds a contiguous range of decoder layers. The embedding, the
final norm and the LM head are on every stage: the last stage's hidden states are broadcast and
every rank computes the same logits and samples the same tokens (models/base.py, worker/).

A checkpoint tensor arrives whole, dense or as a quantized record ({"codes", "scales"[, "mins"]},
layers/quantization/formats.py: per output row, int4 codes two to a byte in groups along the input; a
Q4_K tensor's also its "factors" per group and "super_factors" per 256 inputs, models/gguf_blocks.py):
`local_name` renames it into this rank's model and `local_part` keeps the rows or columns the
rank holds.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.config import ConfigError
from tokenmill.models.loader.arch import ModelArchConfig

Tensor = torch.Tensor | dict[str, torch.Tensor]


def split_range(n: int, parts: int, index: int, unit: int = 1) -> range:
    """The index-th of `parts` contiguous, near-equal ranges covering range(n), cut at multiples of `unit`."""
    units = n // unit
    return range(index * units // parts * unit, (index + 1) * units // parts * unit)


def _unit(n: int, parts: int) -> int:
    """The largest block (128 .. 1) that divides n into at least `parts` pieces: int4 groups and
    kernel tiles stay whole on every rank."""
    return next(u for u in (128, 64, 32, 16, 1) if n % u == 0 and n // u >= parts)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    arch: ModelArchConfig  # the whole model's
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        a, tp = self.arch, self.tp_size
        if tp > 1 and a.num_experts:
            raise ConfigError("tensor_parallel_size", "mixtures of experts are not split by tensor parallelism; "
                              "use --pipeline-parallel-size")
        kv = a.num_key_value_heads
        if tp > kv and (tp % kv or a.num_attention_heads // kv < tp // kv):
            raise ConfigError("tensor_parallel_size", f"{tp} ranks cannot share {kv} KV heads of "
                              f"{a.num_attention_heads // kv} query heads each: it must be at most the KV heads, or a "
                              "multiple of them with at least one query head per rank")
        if a.vocab_size < tp or a.intermediate_size < tp:
            raise ConfigError("tensor_parallel_size", f"{tp} is more ranks than the model has rows to split")
        if self.pp_size > a.num_hidden_layers:
            raise ConfigError("pipeline_parallel_size", f"{self.pp_size} stages for {a.num_hidden_layers} layers")

    @property
    def kv_heads(self) -> range:
        kv, tp = self.arch.num_key_value_heads, self.tp_size
        if kv >= tp:
            return split_range(kv, tp, self.tp_rank)
        head = self.tp_rank // (tp // kv)
        return range(head, head + 1)

    @property
    def q_heads(self) -> range:
        a, tp = self.arch, self.tp_size
        group = a.num_attention_heads // a.num_key_value_heads
        kv = self.kv_heads
        if a.num_key_value_heads >= tp:
            return range(kv.start * group, kv.stop * group)
        per_head = tp // a.num_key_value_heads
        sub = split_range(group, per_head, self.tp_rank % per_head)
        return range(kv.start * group + sub.start, kv.start * group + sub.stop)

    @property
    def intermediate(self) -> range:
        n = self.arch.intermediate_size
        return split_range(n, self.tp_size, self.tp_rank, _unit(n, self.tp_size))

    def vocab_range(self, rank: int | None = None) -> range:
        n = self.arch.vocab_size
        return split_range(n, self.tp_size, self.tp_rank if rank is None else rank, _unit(n, self.tp_size))

    @property
    def vocab_widths(self) -> list[int]:
        """Every tensor-parallel rank's share of the LM head's rows, in rank order."""
        return [len(self.vocab_range(r)) for r in range(self.tp_size)]

    @property
    def layers(self) -> range:
        return split_range(self.arch.num_hidden_layers, self.pp_size, self.pp_rank)

    def local_config(self) -> ModelArchConfig:
        """The shape of this rank's model: its heads, intermediate slice and layers (the vocabulary
        stays whole here; the model builds its own rows of the embedding and head)."""
        a, layers = self.arch, self.layers
        return dataclasses.replace(
            a, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate), num_hidden_layers=len(layers),
            layer_types=None if a.layer_types is None else a.layer_types[layers.start : layers.stop])

    # -- checkpoint tensors --------------------------------------------------------------------

    def local_name(self, name: str) -> str | None:
        """The name in this rank's model of checkpoint tensor `name` (no "model." prefix): a layer
        renumbered within its stage; None for another stage's layer."""
        parts = name.split(".")
        if parts[0] != "layers":
            return name
        layer = int(parts[1])
        if layer not in self.layers:
            return None
        return ".".join([parts[0], str(layer - self.layers.start), *parts[2:]])

    def local_part(self, name: str, tensor: Tensor) -> Tensor:
        """The rows or columns of checkpoint tensor `name` that this rank holds."""
        if self.tp_size == 1:
            return tensor
        parts = name.split(".")
        d = self.arch.head_dim
        q, kv, inter = self.q_heads, self.kv_heads, self.intermediate
        q_rows, kv_rows = range(q.start * d, q.stop * d), range(kv.start * d, kv.stop * d)
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj == "q_proj":
            return _rows(tensor, [q_rows])
        if proj in ("k_proj", "v_proj"):
            return _rows(tensor, [kv_rows])
        if proj == "qkv_proj":  # fused in the checkpoint (Phi-3): q, then k, then v rows
            q_size, kv_size = self.arch.num_attention_heads * d, self.arch.num_key_value_heads * d
            return _rows(tensor, [q_rows, _shift(kv_rows, q_size), _shift(kv_rows, q_size + kv_size)])
        if proj in ("gate_proj", "up_proj"):
            return _rows(tensor, [inter])
        if proj == "gate_up_proj":
            return _rows(tensor, [inter, _shift(inter, self.arch.intermediate_size)])
        if proj == "o_proj" and parts[-1] == "weight":
            return _columns(tensor, q_rows)
        if proj == "down_proj" and parts[-1] == "weight":
            return _columns(tensor, inter)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return _rows(tensor, [self.vocab_range()])
        return tensor


def _shift(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _rows(tensor: Tensor, ranges: list[range]) -> Tensor:
    """The rows in `ranges` of a dense tensor (a bias too) or of every part of a record."""
    if isinstance(tensor, dict):
        return {key: _rows(v, ranges) for key, v in tensor.items()}
    return torch.cat([tensor[r.start : r.stop] for r in ranges]) if len(ranges) > 1 else tensor[ranges[0].start : ranges[0].stop].contiguous()


def _columns(tensor: Tensor, cols: range) -> Tensor:
    """Input columns `cols` of a dense weight or a record (an int4 or int6 record's ranges must fall on its groups)."""
    if not isinstance(tensor, dict):
        return tensor[:, cols.start : cols.stop].contiguous()
    codes = tensor["codes"]
    if tensor["scales"].dim() == 1:  # int8: one scale per row
        return {**tensor, "codes": codes[:, cols.start : cols.stop].contiguous()}
    per_byte = 2 if "mins" in tensor else 1  # int4: two codes a byte; int6: one
    group = codes.shape[1] * per_byte // tensor["scales"].shape[1]
    if cols.start % group or cols.stop % group:
        raise ConfigError("tensor_parallel_size", f"a rank's input columns {cols.start}..{cols.stop} split a "
                          f"quantization group of {group}")
    g = slice(cols.start // group, cols.stop // group)
    part = {"codes": codes[:, cols.start // per_byte : cols.stop // per_byte].contiguous(),
            **{key: tensor[key][:, g].contiguous() for key in ("scales", "mins", "factors") if key in tensor}}
    if "super_factors" in tensor and not (cols.start % 256 or cols.stop % 256):  # Q4_K's, per 256 columns
        part["super_factors"] = tensor["super_factors"][:, cols.start // 256 : cols.stop // 256].contiguous()
    else:  # a rank's share that splits a super-block keeps the scales and mins alone
        part.pop("factors", None)
    return part
