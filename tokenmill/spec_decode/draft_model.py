"""Speculative decoding with a draft model: a small model with the target's vocabulary proposes
each step's drafts, drawn from its own distribution q (kept for verification: `RejectionSampler`).

Its KV cache lives under the same block tables as the target's (same block count and size, its
own layer shapes), so every slot the scheduler hands out holds both models' K/V for that token;
the runner owns that cache and passes it in. In a step the runner calls `forward` after the
target's forward (the draft's K/V of every computed token: a catch-up, then the step's tokens) and
`propose` after sampling and verification.

The requests are the runner's states (worker/request_state.py: CachedRequestState): this reads
their req_id, token_ids, num_prompt_tokens, block_ids, num_computed_tokens and grammar, and sets
their draft_num_computed and draft_probs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tokenmill.layers.attention import BatchLayout
from tokenmill.layers.sampler import AllowedTokens, Sampler, SamplingRow
from tokenmill.layers.step_inputs import StepInputs

KVCaches = list[tuple[torch.Tensor, ...]]


class DraftModelProposer:
    def __init__(self, model, sampler: Sampler, block_size: int, max_model_len: int, device: torch.device,
                 metadata: Callable[[Any, BatchLayout, StepInputs], Any],
                 sampling_row: Callable[[Any, Sequence[int]], SamplingRow],
                 allowed_tokens: Callable[[list[Any]], AllowedTokens | None]):
        """metadata(model, layout, inputs): the model's attention metadata for a pass;
        sampling_row(state, drafts): the request's row scoring the token after `drafts`;
        allowed_tokens(states): the grammar masks of those rows (None: none constrained)."""
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._metadata = metadata
        self._sampling_row = sampling_row
        self._allowed_tokens = allowed_tokens
        # The catch-up and proposal passes' own inputs: the step's are read again by the draft
        # forward over the step's tokens, after the catch-up.
        self.inputs = StepInputs(device)

    def forward(self, requests: Mapping[str, Any], order: list[tuple[str, int]], input_ids: torch.Tensor,
                positions: torch.Tensor, meta, kv_caches: KVCaches) -> None:
        """The draft's K/V for the step's tokens (`input_ids`, `positions` and `meta` are the
        target's step), after catching up on the tokens earlier steps computed without it. The
        caller then counts every request of `order` as caught up."""
        self._catch_up(requests, order, kv_caches)
        self.model(input_ids, positions, kv_caches, meta)

    def _catch_up(self, requests: Mapping[str, Any], order: list[tuple[str, int]], kv_caches: KVCaches) -> None:
        """Write the draft model's K/V for the tokens of this step's requests that earlier steps
        computed without it (they ran while too many requests were running to speculate): one
        draft forward over those tokens as prefill chunks, before the step's own draft forward.
        It is outside the step's token budget; the draft model is small."""
        bs = self.block_size
        tokens, positions, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for req_id, _ in order:
            state = requests[req_id]
            start, end = state.draft_num_computed, state.num_computed_tokens
            if start >= end:
                continue
            tokens.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(state.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            q_lens.append(end - start)
            seq_lens.append(end)
            tables.append(state.block_ids[: -(-end // bs)])
            state.draft_num_computed = end
        if not tokens:
            return
        inputs = self.inputs
        meta = self._metadata(self.model, BatchLayout(bs, slots, [], [], q_lens, seq_lens, tables), inputs)
        tokens_t, positions_t = inputs.longs(tokens), inputs.longs(positions)
        inputs.upload()
        self.model(tokens_t, positions_t, kv_caches, meta)

    def propose(self, requests: Mapping[str, Any], req_ids: list[str], num_drafts: dict[str, int],
                kv_caches: KVCaches) -> dict[str, list[int]]:
        """Up to k drafts per request from the draft model: k batched single-token passes, pass i
        feeding each request's newest token (then its drafts) at position P + i and sampling the
        next draft from the draft's distribution, processed like the target's (temperature,
        top-k/p, penalties). k is the scheduler's `num_drafts` for the request (its adaptive
        draft length, at most the lookahead slots reserved for the drafts' K/V), cut to the
        free slots of its blocks. Returns each proposing request's drafts; its draft_probs hold
        their distributions (None for the others of `req_ids`)."""
        jobs = self._jobs(requests, req_ids, num_drafts)
        if not jobs:
            return {}
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        limits = [n for _, _, n in jobs]  # cut where a grammar ends (its stop token drafted)
        for i in range(max(limits)):
            active = [j for j, n in enumerate(limits) if n > i]
            if not active:
                break
            self._draft_pass(jobs, i, active, drafts, probs, limits, kv_caches)
        proposed = {}
        for (state, _, _), d, q in zip(jobs, drafts, probs):
            if state.grammar is not None:  # back to the state after the request's real tokens
                state.grammar.rollback(state.grammar.num_accepted - (len(state.token_ids) - state.num_prompt_tokens))
            state.draft_probs = torch.stack(q)
            proposed[state.req_id] = d
        return proposed

    def _jobs(self, requests: Mapping[str, Any], req_ids: list[str],
              num_drafts: dict[str, int]) -> list[tuple[Any, int, int]]:
        """(state, position of its newest token, number of drafts to propose) of each request
        with room for a draft, shortest context first (as decode groups want)."""
        bs = self.block_size
        jobs = []
        for req_id in req_ids:
            state = requests[req_id]
            state.draft_probs = None
            pos = len(state.token_ids) - 1
            assert state.draft_num_computed == pos, f"{req_id}: draft K/V behind its tokens"
            n = min(num_drafts.get(req_id, 0), len(state.block_ids) * bs - pos, self.max_model_len - 1 - pos)
            if n > 0:
                jobs.append((state, pos, n))
        jobs.sort(key=lambda job: job[1])
        return jobs

    def _draft_pass(self, jobs: list[tuple[Any, int, int]], i: int, active: list[int], drafts: list[list[int]],
                    probs: list[list[torch.Tensor]], limits: list[int], kv_caches: KVCaches) -> None:
        """Pass i: one token for each `active` job, its draft i appended to `drafts` and q to
        `probs`; a job whose grammar rejects or ends on the draft stops there (`limits`)."""
        bs = self.block_size
        tokens, positions, slots, tables, seq_lens, rows = [], [], [], [], [], []
        for j in active:
            state, pos, _ = jobs[j]
            p = pos + i
            tokens.append(drafts[j][-1] if i else state.token_ids[-1])
            positions.append(p)
            slots.append(state.block_ids[p // bs] * bs + p % bs)
            tables.append(state.block_ids[: p // bs + 1])
            seq_lens.append(p + 1)
            rows.append(self._sampling_row(state, drafts[j]))
        inputs = self.inputs
        meta = self._metadata(self.model, BatchLayout(bs, slots, tables, seq_lens, [], [], []), inputs)
        tokens_t, positions_t = inputs.longs(tokens), inputs.longs(positions)
        inputs.upload()
        hidden = self.model(tokens_t, positions_t, kv_caches, meta)
        # A constrained request's drafts follow its grammar: q is masked like the target's p.
        allowed = self._allowed_tokens([jobs[j][0] for j in active])
        q = self.sampler.probs(self.model.compute_logits(hidden), rows, allowed)
        for j, token, row_q in zip(active, self.sampler.sample_from(q, rows), q):
            drafts[j].append(token)
            probs[j].append(row_q)
            grammar = jobs[j][0].grammar
            if grammar is not None and (not grammar.accept([token]) or grammar.is_terminated):
                limits[j] = i + 1
