"""Speculative sampling: accept or reject draft tokens so that every emitted token has exactly the
target's distribution (`Sampler.verify` processes the logits and draws the randomness, then calls
`rejection_sample`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.uploads import to_device


@dataclass
class SpecSamplerOutput:
    token_ids: list[list[int]]  # per request: accepted drafts + one target token
    logprobs: list[list[float]] | None  # per request, per emitted token (when some row asked)
    top_logprobs: list[list[list[tuple[int, float]]]] | None


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[list[int]], draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for a batch of requests.

    target_probs: [sum(k_r + 1), vocab_size], each request's k_r + 1 rows in order (p);
    draft_probs: [sum(k_r), vocab_size] the draft's distributions q, or None for one-hot q at
    each draft token; uniforms: [sum(k_r)] U[0, 1); noise: [num_requests, vocab_size] Exp(1).
    Draft token x at row i is accepted with probability min(1, p_i(x) / q_i(x)); the first
    rejection at row i draws from normalize(max(0, p_i - q_i)), a fully accepted draft draws a
    bonus token from p_k. Returns per request the emitted tokens, and the index of its first row."""
    device = target_probs.device
    num_drafts = [len(d) for d in draft_token_ids]
    first_rows: list[int] = []
    draft_rows: list[int] = []
    start = 0
    for k in num_drafts:
        first_rows.append(start)
        draft_rows.extend(range(start, start + k))
        start += k + 1
    flat_drafts = [t for d in draft_token_ids for t in d]
    accepted: list[bool] = []
    if flat_drafts:
        drafts_t, rows_t = to_device([flat_drafts, draft_rows], torch.long, device)
        p = target_probs[rows_t, drafts_t]
        q = (draft_probs.gather(1, drafts_t[:, None])[:, 0] if draft_probs is not None
             else torch.ones_like(p))
        accepted = (uniforms * q < p).tolist()  # u < p / q, without dividing by a tiny q
    num_accepted: list[int] = []
    draft_starts: list[int] = []  # each request's first draft in the flat list
    d = 0
    for k in num_drafts:
        a = 0
        while a < k and accepted[d + a]:
            a += 1
        num_accepted.append(a)
        draft_starts.append(d)
        d += k
    final = target_probs[to_device([f + a for f, a in zip(first_rows, num_accepted)], torch.long, device)]
    rejected = [r for r, (a, k) in enumerate(zip(num_accepted, num_drafts)) if a < k]
    if rejected:
        draft_index = [draft_starts[r] + num_accepted[r] for r in rejected]
        # The rejected requests' rows, their rejected drafts' rows in draft_probs, and those drafts.
        rej, rej_draft_rows, rej_drafts = to_device([rejected, draft_index, [flat_drafts[i] for i in draft_index]],
                                                     torch.long, device)
        if draft_probs is not None:
            residual = (final[rej] - draft_probs[rej_draft_rows]).clamp_(min=0)
        else:
            residual = final[rej].clone()
            residual[torch.arange(len(rejected), device=device), rej_drafts] = 0
        # p == q up to rounding leaves nothing: then the target row itself (measure zero).
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        final[rej] = torch.where(empty, final[rej], residual)
    last = (final / noise).argmax(dim=-1).tolist()
    tokens = [list(draft[:a]) + [t] for draft, a, t in zip(draft_token_ids, num_accepted, last)]
    return tokens, first_rows
