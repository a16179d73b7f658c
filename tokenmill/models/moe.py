"""Mixtures of experts: the routed-experts MLP (`MoEMLP`) and the model base of the families whose
MLPs it is (`MoEForCausalLM`: models/mixtral.py, models/qwen2_moe.py), which stacks each
expert's checkpoint projections into one tensor per layer.

The compiled CPU decoder has no experts: these families run their Python layers every step, and
take no activation sparsity (an expert's MLP takes no thresholds).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.base import CausalLM
from tokenmill.models.llama import activation
from tokenmill.models.loader.arch import ModelArchConfig


class MoEMLP(nn.Module):
    """The router's softmax picks each token's top-k experts (weights renormalized when
    `norm_topk_prob`), each expert a gated MLP. Tokens are sorted by expert and each expert with
    tokens runs one matmul over all of its rows (a loop over experts, never over tokens)."""

    def __init__(self, config: ModelArchConfig):
        super().__init__()
        e, inner, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k, self.norm_topk_prob, self.inner = config.num_experts_per_tok, config.norm_topk_prob, inner
        self.gate = nn.Linear(hidden, e, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * inner, hidden))  # each expert's gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, hidden, inner))
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, sparse: None = None) -> torch.Tensor:
        """sparse: always None (MoEForCausalLM refuses activation sparsity)."""
        weights = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = weights.topk(self.top_k, dim=-1)  # [n, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // self.top_k
        rows = x[tokens]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                gate, up = F.linear(rows[start:end], self.w13[e]).split(self.inner, dim=-1)
                out_rows[start:end] = F.linear(self.act(gate) * up, self.w2[e])
                start = end
        return torch.zeros_like(x).index_add_(0, tokens, out_rows * weights.flatten()[order, None])


class MoEForCausalLM(CausalLM):
    takes_cpu_decoder = False  # the DecoderStack has no experts
    # An expert's checkpoint projections (layers.i.mlp.experts.e.<name>.weight) -> (our stacked
    # parameter, shard within the expert).
    expert_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    # Checkpoint module names that are another here (Mixtral's block_sparse_moe is our mlp).
    renamed_modules: ClassVar[dict[str, str]] = {}

    has_experts = True

    @classmethod
    def expert_weight_name(cls, layer: int | str, expert: int, part: tuple[str, int]) -> str:
        """The checkpoint name of expert `expert`'s projection that fills `part` (a value of
        `expert_modules`: stacked parameter, shard) of layer `layer`."""
        name = next(name for name, value in cls.expert_modules.items() if value == part)
        mlp = next((theirs for theirs, ours in cls.renamed_modules.items() if ours == "mlp"), "mlp")
        return f"model.layers.{layer}.{mlp}.experts.{expert}.{name}.weight"

    @classmethod
    def mlp_weight_shapes(cls, config: ModelArchConfig, layer: str) -> dict[str, tuple[int, ...]]:
        """The router's weight, then each expert's gate, up and down projections."""
        if not config.num_experts:
            return super().mlp_weight_shapes(config, layer)
        hidden, inner, i = config.hidden_size, config.moe_intermediate_size, layer.rpartition(".")[2]
        router = cls.expert_weight_name(i, 0, ("w13", 0)).partition(".experts.")[0] + ".gate.weight"
        shapes = {router: (config.num_experts, hidden)}
        for e in range(config.num_experts):
            shapes |= {cls.expert_weight_name(i, e, ("w13", 0)): (inner, hidden),
                       cls.expert_weight_name(i, e, ("w13", 1)): (inner, hidden),
                       cls.expert_weight_name(i, e, ("w2", 0)): (hidden, inner)}
        return shapes

    @classmethod
    def gguf_fields(cls, gguf) -> dict:
        """The experts' fields from llama.cpp's metadata (norm_topk_prob: True unless a family says not)."""
        return dict(num_experts=int(gguf.get("expert_count", 0) or 0),
                    num_experts_per_tok=int(gguf.get("expert_used_count")),
                    moe_intermediate_size=int(gguf.get("expert_feed_forward_length", None)
                                              or gguf.get("feed_forward_length")),
                    shared_expert_intermediate_size=int(gguf.get("expert_shared_feed_forward_length", 0)),
                    norm_topk_prob=True)

    def enable_activation_sparsity(self, thresholds: torch.Tensor, prefill: bool = False) -> None:
        raise ValueError("activation sparsity: not for mixtures of experts (their MLP takes no thresholds)")

    def _placement(self, params: dict, name: str) -> tuple[str, object, torch.Tensor] | None:
        """As CausalLM's, an expert's projection going into its rows of the layer's w13 or w2 (shard
        key: (expert, 0 or 1))."""
        parts = [self.renamed_modules.get(part, part) for part in name.split(".")]
        if "experts" not in parts:
            return super()._placement(params, ".".join(parts))
        if not (len(parts) == 7 and parts[2] == "mlp" and parts[3] == "experts" and parts[5] in self.expert_modules):
            return None
        stacked, half = self.expert_modules[parts[5]]
        ours, expert = ".".join(parts[:3] + [stacked]), int(parts[4])
        if ours not in params or expert >= params[ours].shape[0]:
            return None
        target = params[ours][expert]
        if stacked == "w13":
            inner = target.shape[0] // 2
            target = target.narrow(0, half * inner, inner)
        return ours, (expert, half), target

    def _expected_shards(self, name: str, param: torch.Tensor) -> set:
        if name.endswith(".w13"):
            return {(e, h) for e in range(param.shape[0]) for h in (0, 1)}
        if name.endswith(".w2"):
            return {(e, 0) for e in range(param.shape[0])}
        return super()._expected_shards(name, param)
