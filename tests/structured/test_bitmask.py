"""The bitmask layout and its application to logits, and the sampler's constrained rows
(plain torch: no grammar backend, no model)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.sampler import AllowedTokens, Sampler, SamplingRow
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.rejection import RejectionSampler
from tokenmill.structured.bitmask import allocate_bitmask, apply_bitmask_, masked, num_words


def bitmask_of(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    bitmask = torch.zeros(len(allowed), num_words(vocab_size), dtype=torch.int32)
    for row, ids in enumerate(allowed):
        for t in ids:
            word = int(bitmask[row, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_ids", [None, [0, 2], [1]], ids=["all", "some", "one"])
def test_apply_keeps_exactly_the_allowed_tokens_of_the_listed_rows(dtype, row_ids):
    vocab_size = 100  # not a multiple of 32: the last word is partly padding
    allowed = [[0, 31, 32, 63, 99], [5], list(range(7, 100))]
    logits = torch.randn(3, vocab_size).to(dtype)
    x = logits.clone()
    apply_bitmask_(x, bitmask_of(allowed, vocab_size), row_ids)
    for row, ids in enumerate(allowed):
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[ids] = True
        if row_ids is not None and row not in row_ids:
            keep[:] = True
        assert torch.equal(x[row][keep], logits[row][keep])
        assert bool((x[row][~keep] == float("-inf")).all())


def test_allocate_allows_everything_and_shapes_are_checked():
    bitmask = allocate_bitmask(2, 70)
    assert bitmask.shape == (2, 3) and bitmask.dtype == torch.int32
    x = torch.randn(2, 70)
    y = x.clone()
    apply_bitmask_(y, bitmask)
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_bitmask_(x, allocate_bitmask(3, 70))


def rows_of(params_list):
    return [SamplingRow(p, [1, 2], [], [0]) for p in params_list]


def test_sampler_constrains_only_the_listed_rows_greedy_and_sampled():
    vocab_size = 64
    torch.manual_seed(0)
    logits = torch.randn(4, vocab_size)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)]
    # Rows 1 and 2 are constrained to tokens their argmax is not.
    allowed_ids = [[3, 40], [7]]
    for ids, row in zip(allowed_ids, (1, 2)):
        assert int(logits[row].argmax()) not in ids
    allowed = AllowedTokens([1, 2], bitmask_of([[]] + allowed_ids + [[]], vocab_size))  # rows 0, 3 not read
    sampler = Sampler(seed=0)
    before = logits.clone()
    for _ in range(20):
        out = sampler(logits, rows_of(params), allowed)
        assert out.token_ids[1] in (3, 40) and out.token_ids[2] == 7
        assert out.token_ids[0] == int(logits[0].argmax())
    assert torch.equal(logits, before)  # the caller's logits are never modified
    unconstrained = sampler(logits, rows_of(params))
    assert [unconstrained.token_ids[i] for i in (0, 3)] == [out.token_ids[i] for i in (0, 3)]  # seeded rows
    probs = sampler.probs(logits, rows_of(params), allowed)
    assert set(probs[1].nonzero()[:, 0].tolist()) <= {3, 40} and probs[2, 7] == 1.0


def test_logprobs_are_those_of_the_raw_logits():
    logits = torch.randn(1, 64)
    out = Sampler()(logits, rows_of([SamplingParams(temperature=0.0, logprobs=1)]),
                    AllowedTokens([0], bitmask_of([[9]], 64)))
    assert out.token_ids == [9]
    assert out.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[9]), abs=1e-5)


def test_verify_rejects_a_draft_its_row_does_not_allow():
    vocab_size = 64
    logits = torch.full((3, vocab_size), -5.0)
    logits[:, 10] = 5.0  # the model's favourite everywhere
    rows = rows_of([SamplingParams(temperature=0.0)] * 3)
    # Drafts [10, 10]: row 1 (after draft 0) does not allow 10, only 11.
    allowed = AllowedTokens([0, 1, 2], bitmask_of([[10, 11], [11], list(range(vocab_size))], vocab_size))
    out = RejectionSampler(Sampler()).verify(logits, rows, [[10, 10]], None, allowed)
    assert out.token_ids == [[10, 11]]


@pytest.mark.parametrize("row_ids", [None, [1]], ids=["all", "one"])
def test_masked_is_apply_on_a_copy(row_ids):
    logits = torch.randn(2, 70).to(torch.bfloat16)
    bitmask = bitmask_of([[1, 2, 69], [0, 40]], 70)
    before = logits.clone()
    out = masked(logits, bitmask, row_ids)
    assert torch.equal(logits, before)
    expected = logits.clone()
    apply_bitmask_(expected, bitmask, row_ids)
    assert torch.equal(out, expected)


def test_greedy_rows_of_bf16_logits_are_masked_in_their_dtype():
    logits = torch.randn(3, 64).to(torch.bfloat16)
    rows = rows_of([SamplingParams(temperature=0.0)] * 3)
    out = Sampler()(logits, rows, AllowedTokens([0, 2], bitmask_of([[5, 6], [], [63]], 64)))
    assert out.token_ids[0] == 5 + int(logits[0, 6] > logits[0, 5]) and out.token_ids[2] == 63
    assert out.token_ids[1] == int(logits[1].float().argmax())
