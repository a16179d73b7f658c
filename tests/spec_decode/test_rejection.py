"""The speculative rejection sampler: hand-made distributions, then a statistical test that
sampling with speculation draws from the same distribution as sampling without it."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.sampler import Sampler, SamplingRow
from tokenmill.spec_decode.rejection import RejectionSampler, rejection_sample
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def rows_for(params, num_rows, output=()):
    return [SamplingRow(params, [1, 2], list(output) + [0] * i, [99]) for i in range(num_rows)]


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 5] = logits[2, 6] = logits[3, 1] = 5.0  # argmax after each draft
    sampler = RejectionSampler(Sampler(seed=0))
    out = sampler.verify(logits, rows_for(GREEDY, 4), [[3, 5, 6]])
    assert out.token_ids == [[3, 5, 6, 1]]  # all accepted + the bonus token
    out = sampler.verify(logits, rows_for(GREEDY, 4), [[3, 2, 6]])
    assert out.token_ids == [[3, 5]]  # rejected at the second draft, corrected to the argmax
    out = sampler.verify(logits, rows_for(GREEDY, 4), [[0, 5, 6]])
    assert out.token_ids == [[3]]


def test_several_requests_of_different_draft_lengths_in_one_batch():
    logits = torch.full((6, 8), -5.0)
    for row, token in enumerate([2, 4, 7, 1, 0, 3]):
        logits[row, token] = 5.0
    # request 0: rows 0-2, drafts [2, 4]; request 1: row 3, no drafts; request 2: rows 4-5, drafts [6]
    rows = rows_for(GREEDY, 3) + rows_for(GREEDY, 1) + rows_for(GREEDY, 2)
    out = RejectionSampler(Sampler(seed=0)).verify(logits, rows, [[2, 4], [], [6]])
    assert out.token_ids == [[2, 4, 7], [1], [0]]


def test_rejection_sample_one_hot_draft_on_hand_made_numbers():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    noise = torch.tensor([[1.0, 1.0, 1.0, 1.0]])  # argmax(p / 1) = the most likely remaining token
    # u = 0.4 < p(0) = 0.5: accepted, then the bonus token from row 1
    tokens, first = rejection_sample(p, [[0]], None, torch.tensor([0.4]), noise)
    assert tokens == [[0, 3]] and first == [0]
    # u = 0.6 >= 0.5: rejected; the residual is p without token 0, so token 1 (0.3) is drawn
    tokens, _ = rejection_sample(p, [[0]], None, torch.tensor([0.6]), noise)
    assert tokens == [[1]]
    # a draft the target gives probability 0 is never accepted
    tokens, _ = rejection_sample(p, [[3]], None, torch.tensor([0.0]), noise)
    assert tokens == [[0]]


def test_rejection_sample_with_draft_probabilities():
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4]])
    noise = torch.ones(1, 2)
    # accept with min(1, p/q) = 0.2 / 0.6 = 1/3
    assert rejection_sample(p, [[0]], q, torch.tensor([0.3]), noise)[0] == [[0, 0]]
    # rejected: residual max(0, p - q) = [0, 0.4] -> token 1, whatever the noise favoured
    assert rejection_sample(p, [[0]], q, torch.tensor([0.34]), torch.tensor([[1e-6, 1.0]]))[0] == [[1]]
    # p(x) >= q(x): always accepted
    assert rejection_sample(p, [[1]], q, torch.tensor([0.999]), noise)[0] == [[1, 0]]


def test_verify_checks_the_row_count():
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler(Sampler()).verify(torch.zeros(3, 4), rows_for(GREEDY, 3), [[1]])


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two equal-size samples' counts per category -> the chi-square statistic."""
    both = a + b
    keep = both > 0
    return float(((a - b)[keep].double() ** 2 / both[keep].double()).sum())


# Critical value of chi-square with 7 degrees of freedom at p = 0.001 (8 categories).
CHI2_CRIT_DF7 = 24.32
N = 40_000
VOCAB = 8


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
], ids=["plain", "top-k-top-p", "top-p-min-p"])
@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one-hot-draft", "draft-model"])
def test_speculative_sampling_matches_plain_sampling(params, with_draft_probs):
    """A tiny 'model' over 8 tokens: fixed logits for the first position and for the position
    after the draft token. N requests each verify one draft; the first emitted token must follow
    the plain sampler's distribution at position 0 and, when the draft was accepted, the second
    one its distribution at position 1 (two-sample chi-square, p = 0.001, fixed seeds)."""
    gen = torch.Generator().manual_seed(0)
    logits0 = torch.randn(VOCAB, generator=gen) * 1.5
    logits1 = torch.randn(VOCAB, generator=gen) * 1.5
    row = SamplingRow(params, [1, 2], [], [99])
    row1 = SamplingRow(params, [1, 2], [0], [99])

    # Without speculation: the plain sampler, N draws per position.
    plain = Sampler(seed=1)
    first_plain = torch.tensor(plain(logits0.expand(N, VOCAB), [row] * N).token_ids)
    second_plain = torch.tensor(plain(logits1.expand(N, VOCAB), [row1] * N).token_ids)

    # With speculation: each request's draft is a fixed token (one-hot q, as n-gram lookup
    # proposes) or a sample from a draft distribution q.
    if with_draft_probs:
        q = torch.softmax(torch.randn(VOCAB, generator=gen), dim=0)
        drafts = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
        draft_probs = q.expand(N, VOCAB)
    else:
        drafts = [int(logits0.argsort()[-2])] * N  # the second most likely token
        draft_probs = None
    # The row after a draft: logits1 are used whatever the draft was (a model whose next-token
    # distribution ignores the previous token), so the second token's law is known.
    logits = torch.stack([logits0, logits1]).repeat(N, 1)
    spec = RejectionSampler(Sampler(seed=2)).verify(logits, [row, row1] * N, [[d] for d in drafts], draft_probs)
    first_spec = torch.tensor([t[0] for t in spec.token_ids])
    second_spec = torch.tensor([t[1] for t in spec.token_ids if len(t) == 2])
    assert 0.05 * N < len(second_spec) < N  # some drafts accepted, some rejected

    counts = lambda t: torch.bincount(t, minlength=VOCAB)  # noqa: E731
    assert _two_sample_chi2(counts(first_spec), counts(first_plain)) < CHI2_CRIT_DF7
    # The accepted subsample has fewer draws: compare proportions scaled to its size.
    m = len(second_spec)
    scaled = counts(second_plain[:m])
    assert _two_sample_chi2(counts(second_spec), scaled) < CHI2_CRIT_DF7
    tv = 0.5 * (counts(first_spec) / N - counts(first_plain) / N).abs().sum()
    assert tv < 0.02

    # The test has power: accepting every draft (no rejection step) fails it.
    naive = torch.tensor(drafts)
    assert _two_sample_chi2(counts(naive), counts(first_plain)) > CHI2_CRIT_DF7
