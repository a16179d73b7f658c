"""Prompt logprobs: log p of each prompt token a step computes, given the tokens before it, and
the most likely tokens there, from the hidden states of the step's forward pass.

They are computed apart from the sampled rows, a slice of rows at a time, so that a long prompt
chunk never holds its whole [rows, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokenmill.core.outputs import ModelRunnerOutput
from tokenmill.worker.inputs import PromptLogprobsJob
from tokenmill.worker.request_state import CachedRequestState


def prompt_logprobs(model, hidden: torch.Tensor, jobs: list[PromptLogprobsJob],
                    requests: Mapping[str, CachedRequestState], device: torch.device, out: ModelRunnerOutput) -> None:
    """Each job's prompt logprobs into `out`, and as many top logprobs at each position as its
    request's `logprobs` asks for."""
    for req_id, indices, targets in jobs:
        num_top = requests[req_id].sampling_params.logprobs or 0
        out.prompt_logprobs[req_id], tops = token_logprobs(model, hidden, indices, targets, device, num_top)
        if num_top:
            out.prompt_top_logprobs[req_id] = tops


def token_logprobs(model, hidden: torch.Tensor, indices: range, targets: list[int], device: torch.device,
                   num_top: int = 0, rows_per_slice: int = 256) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """log p(targets[i] | context up to flat position indices[i]) and, with num_top, the
    num_top most likely (token_id, logprob) there; a slice of rows at a time so the
    [rows, vocab] logits stay small."""
    result: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for lo in range(0, len(indices), rows_per_slice):
        idx = indices[lo : lo + rows_per_slice]
        logprobs = torch.log_softmax(model.compute_logits(hidden[idx.start : idx.stop]), dim=-1)
        target = torch.tensor(targets[lo : lo + rows_per_slice], device=device)
        result.extend(logprobs.gather(1, target[:, None]).squeeze(1).tolist())
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top], descending
            tops.extend(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
    return result, tops
