"""Speculative sampling: accept or reject draft tokens so that every emitted token has exactly the
target's distribution. `RejectionSampler.verify` processes the logits through the sampler's
stages (`Sampler.probs`) and draws the randomness, then calls `rejection_sample`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampler import AllowedTokens, Sampler, SamplingRow, check_rows, gather_logprobs
from tokenmill.layers.uploads import to_device

# Mixed into a seeded row's generator seed for speculative verification, so its draws are not
# the same numbers the sampler would draw at that position.
_SPEC_STREAM = 0x5BEC_DEC0DE


@dataclass
class SpecSamplerOutput:
    token_ids: list[list[int]]  # per request: accepted drafts + one target token
    logprobs: list[list[float]] | None  # per request, per emitted token (when some row asked)
    top_logprobs: list[list[list[tuple[int, float]]]] | None


class RejectionSampler:
    """Verification of draft tokens over a `Sampler`: its stages give the target distribution p,
    its generators the randomness (a seeded request's draws depend on its seed and output
    position only, as in plain sampling)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], draft_token_ids: list[list[int]],
               draft_probs: torch.Tensor | None = None, allowed: AllowedTokens | None = None) -> SpecSamplerOutput:
        """Accept or reject each request's draft tokens, keeping the distribution of every
        emitted token exactly what the sampler would sample.

        Request r contributes k_r = len(draft_token_ids[r]) + 1 consecutive rows of `logits`
        and `rows`: row i scores the token after draft i (row 0: after the request's last real
        token), and its SamplingRow's output_token_ids already include drafts 0..i-1.
        `draft_probs` [total drafts, vocab_size] is the draft model's distribution q for each
        draft token; None means one-hot q (drafts proposed without probabilities, e.g. n-gram).
        `allowed` constrains rows like the sampler's: a draft its row does not allow has p = 0
        and is rejected, and the token drawn instead is one the row allows.
        Returns per request the accepted drafts plus one token drawn by the target (a correction
        from the residual distribution, or a bonus token after a fully accepted draft)."""
        check_rows(logits, rows)
        target = self.sampler.probs(logits, rows, allowed)
        num_drafts = [len(d) for d in draft_token_ids]
        if sum(num_drafts) + len(num_drafts) != len(rows):
            raise ValueError(f"{len(rows)} rows for {len(num_drafts)} requests with {sum(num_drafts)} drafts")
        uniforms, noise = self._randomness(rows, num_drafts, logits.device, logits.shape[1])
        token_ids, first_rows = rejection_sample(target, draft_token_ids, draft_probs, uniforms, noise)
        out = SpecSamplerOutput(token_ids, None, None)
        if any(row.params.logprobs is not None for row in rows):
            out.logprobs, out.top_logprobs = _emitted_logprobs(logits, rows, token_ids, first_rows)
        return out

    def _randomness(self, rows: list[SamplingRow], num_drafts: list[int], device: torch.device,
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request one uniform per draft ([sum(k_r)] U[0, 1)) and one Exp(1) row for its final
        token ([num_requests, vocab_size]). A request with a seed draws them from (seed, output
        position) like the sampler does, on the verification stream."""
        uniforms = torch.empty(sum(num_drafts), device=device)
        noise = torch.empty(len(num_drafts), vocab_size, device=device)
        shared = self.sampler.shared_generator(device)
        uniforms.uniform_(generator=shared)
        noise.uniform_(generator=shared)
        start = draft_start = 0
        for r, k in enumerate(num_drafts):
            row = rows[start]
            if row.params.seed is not None:
                gen = self.sampler.row_generator(device, row.params.seed, len(row.output_token_ids), _SPEC_STREAM)
                uniforms[draft_start : draft_start + k].uniform_(generator=gen)
                noise[r].uniform_(generator=gen)
            start += k + 1
            draft_start += k
        return uniforms, noise.log_().neg_()


def _emitted_logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[list[int]],
                      first_rows: list[int]) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
    """The raw logprobs (and top logprobs) of each request's emitted tokens, per request."""
    emitted_rows = [first + i for first, tokens in zip(first_rows, token_ids) for i in range(len(tokens))]
    rows_t, flat = to_device([emitted_rows, [t for tokens in token_ids for t in tokens]], torch.long, logits.device)
    lps, tops = gather_logprobs(logits[rows_t].float(), flat, [rows[i] for i in emitted_rows])
    logprobs, top_logprobs = [], []
    i = 0
    for tokens in token_ids:
        logprobs.append(lps[i : i + len(tokens)])
        top_logprobs.append(tops[i : i + len(tokens)])
        i += len(tokens)
    return logprobs, top_logprobs


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
