"""A step's flat batch: the scheduled tokens of every request as one forward pass's inputs
(`StepBatch`: token ids, positions, each token's cache slot, each decode's and chunk's block
table and lengths), and which of its rows get logits.

Decodes (one query token) come first, shortest context first, then prefill chunks, as the
attention backends expect (`BatchLayout`). A request verifying k drafts is a chunk of its last
known token and its drafts; its 1 + k logit rows follow those of the requests sampled plainly.
Prompt positions of requests that asked for prompt logprobs are listed too (their logits are
computed a slice at a time, apart from the sampled rows).

The integer tensors of the pass are views of the runner's persistent buffers
(`layers/step_inputs.py`); `prepare_inputs` takes the first of them, the sampled rows' index,
when those rows are not the batch's first ones in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tokenmill.core.outputs import SchedulerOutput
from tokenmill.layers.attention import BatchLayout
from tokenmill.layers.step_inputs import StepInputs
from tokenmill.worker.request_state import CachedRequestState

SpecJob = tuple[str, int, list[int]]  # (req_id, flat index of its last known token, its drafts)
PromptLogprobsJob = tuple[str, range, list[int]]  # (req_id, flat indices, the prompt tokens they predict)


@dataclass(slots=True)
class StepBatch:
    """One step's flat batch, as `prepare_inputs` builds it and the runner's later steps read it."""

    order: list[tuple[str, int]]  # (req_id, number of scheduled tokens), in batch order
    layout: BatchLayout  # each token's slot; each decode's and chunk's block table and lengths
    input_ids: list[int] = field(default_factory=list)  # [num_tokens]
    positions: list[int] = field(default_factory=list)  # [num_tokens]
    sample_req_ids: list[str] = field(default_factory=list)  # requests sampled one token, no drafts
    # The flat indices that get logits: one per sampled request, then each spec job's 1 + k.
    sample_indices: list[int] = field(default_factory=list)
    spec_jobs: list[SpecJob] = field(default_factory=list)  # requests verifying drafts
    prompt_lp_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    sampled_rows: slice | torch.Tensor = field(default_factory=lambda: slice(0))  # sample_indices, indexing the hidden states


def batch_order(requests: Mapping[str, CachedRequestState], num_scheduled_tokens: dict[str, int]) -> list[tuple[str, int]]:
    """(req_id, number of scheduled tokens): decodes first, shortest context first, then prefill
    chunks, as the attention backend expects."""
    return sorted(
        num_scheduled_tokens.items(),
        key=lambda item: (item[1] != 1, requests[item[0]].num_computed_tokens if item[1] == 1 else 0),
    )


def prepare_inputs(requests: Mapping[str, CachedRequestState], sched: SchedulerOutput, block_size: int,
                   inputs: StepInputs) -> StepBatch:
    """The step's flat batch over the states of the scheduled requests (not yet advanced: their
    num_computed_tokens is where this step's tokens start)."""
    batch = StepBatch(batch_order(requests, sched.num_scheduled_tokens), BatchLayout(block_size, [], [], [], [], [], []))
    for req_id, num_new in batch.order:
        _add_request(batch, requests[req_id], num_new, sched.scheduled_spec_tokens.get(req_id))
    for _, first, drafts in batch.spec_jobs:  # each scores its last known token and every draft
        batch.sample_indices.extend(range(first, first + len(drafts) + 1))
    # The hidden rows that get logits: the first ones, in order (a step whose decodes are all
    # sampled: plain indices ascend, so the last one says it), or gathered.
    indices = batch.sample_indices
    in_order = not batch.spec_jobs and (not indices or indices[-1] == len(indices) - 1)
    batch.sampled_rows = slice(0, len(indices)) if in_order else inputs.longs(indices)
    return batch


def _add_request(batch: StepBatch, state: CachedRequestState, num_new: int, drafts: list[int] | None) -> None:
    """Append the request's `num_new` scheduled tokens (the last of them its drafts, if any) to
    the batch: ids, positions, slots, its decode or chunk, and the rows it wants logits at."""
    layout, bs = batch.layout, batch.layout.block_size
    start = state.num_computed_tokens
    end = start + num_new
    known_end = end - len(drafts) if drafts else end
    assert known_end <= len(state.token_ids), f"{state.req_id}: scheduled past its known tokens"
    blocks = state.block_ids
    last_predicting = min(end, state.num_prompt_tokens - 1)
    if state.sampling_params.prompt_logprobs and start < last_predicting:
        first = len(batch.input_ids)
        batch.prompt_lp_jobs.append(
            (state.req_id, range(first, first + last_predicting - start), state.token_ids[start + 1 : last_predicting + 1])
        )
    batch.input_ids.extend(state.token_ids[start:known_end])
    if drafts:
        batch.input_ids.extend(drafts)
    batch.positions.extend(range(start, end))
    layout.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
    num_ctx_blocks = -(-end // bs)
    if num_new == 1:
        layout.decode_tables.append(blocks[:num_ctx_blocks])
        layout.decode_seq_lens.append(end)
    else:
        layout.prefill_query_lens.append(num_new)
        layout.prefill_seq_lens.append(end)
        layout.prefill_tables.append(blocks[:num_ctx_blocks])
    if drafts:
        batch.spec_jobs.append((state.req_id, len(batch.input_ids) - len(drafts) - 1, drafts))
    elif end == len(state.token_ids):
        batch.sample_req_ids.append(state.req_id)
        batch.sample_indices.append(len(batch.input_ids) - 1)
