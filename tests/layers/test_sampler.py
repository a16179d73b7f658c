import dataclasses
import math

import pytest
import torch

from tests.layers.levels import kernel_test_levels
from tokenmill.layers import cpu_kernels
from tokenmill.layers.sampler import (
    Sampler,
    SamplingRow,
    _add_logit_bias,
    _apply_top_k_top_p,
    _apply_frequency_presence_penalties,
    _apply_repetition_penalty,
)
from tokenmill.sampling_params import SamplingParams

EOS = 0


def row(prompt=(), output=(), eos=(EOS,), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), list(eos))


# The compiled levels the kernel tests build anyway.
KERNEL_LEVELS = kernel_test_levels()


@pytest.fixture(params=["torch", *KERNEL_LEVELS])
def kernels(request):
    """None (the PyTorch path), or the CPU kernels of one level (their sample_rows)."""
    if request.param == "torch":
        return None
    module = cpu_kernels.load(request.param)
    if module is None:
        pytest.skip(f"CPU kernels ({request.param}) not built here: {cpu_kernels.build_error(request.param)}")
    return module


def sample_frequencies(logits_row: torch.Tensor, num_draws: int, kernels=None, **params) -> torch.Tensor:
    """Frequencies of num_draws independent draws from one row (one batch of identical rows)."""
    sampler = Sampler(seed=1234, kernels=kernels)
    shared = row(**params)
    logits = logits_row.unsqueeze(0).expand(num_draws, -1)
    token_ids = torch.tensor(sampler(logits, [shared] * num_draws).token_ids)
    return torch.bincount(token_ids, minlength=logits_row.numel()).float() / num_draws


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# -- greedy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = Sampler()(logits, [row(temperature=0) for _ in range(7)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [row(temperature=1.3, top_k=1) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    rows = [row(temperature=0) if i % 2 else row(temperature=5.0) for i in range(6)]
    out = Sampler(seed=0)(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]
    # At temperature 5 over 40 tokens, three argmax hits in a row are unlikely (and seeded).
    assert [out.token_ids[i] for i in (0, 2, 4)] != [argmax[i] for i in (0, 2, 4)]


def test_logits_are_not_modified():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    Sampler()(
        logits,
        [
            row(logit_bias={1: 5.0}, temperature=0),
            row(output=[2], min_tokens=3, stop_token_ids=[4], repetition_penalty=1.5),
            row(output=[2, 2], frequency_penalty=1.0, top_p=0.5, top_k=3, logprobs=2),
        ],
    )
    assert torch.equal(logits, before)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.zeros(3, 10), [row(), row()])


# -- random sampling ------------------------------------------------------------------------------


def test_temperature_sampling_matches_softmax(kernels):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    expected = (logits / 0.7).softmax(-1)
    # The test can tell temperatures apart.
    assert (expected - logits.softmax(-1)).abs().max() > 0.05
    freq = sample_frequencies(logits, 40_000, temperature=0.7, kernels=kernels)
    # Standard error of each frequency is <= 0.0025; 0.01 is 4 sigma.
    assert (freq - expected).abs().max() < 0.01
    chi2 = (40_000 * (freq - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # 99.9th percentile of chi-square with 5 degrees of freedom


def test_top_k_keeps_only_k_tokens(kernels):
    logits = torch.tensor([0.1, 3.0, -1.0, 2.5, 0.0, 2.0, 1.0, -2.0])
    freq = sample_frequencies(logits, 20_000, top_k=3, kernels=kernels)
    assert set(freq.nonzero().flatten().tolist()) == {1, 3, 5}
    expected = torch.zeros(8)
    expected[[1, 3, 5]] = logits[[1, 3, 5]].softmax(-1)
    assert (freq - expected).abs().max() < 0.015


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.49, {0}),
        (0.51, {0, 1}),
        (0.79, {0, 1}),
        (0.81, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept, kernels):
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    freq = sample_frequencies(logits, 4_000, top_p=top_p, kernels=kernels)
    assert set(freq.nonzero().flatten().tolist()) == kept
    expected = torch.zeros(4)
    expected[list(kept)] = logits[list(kept)].softmax(-1)
    assert (freq - expected).abs().max() < 0.03


def test_top_k_then_top_p(kernels):
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # top_k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only the first.
    freq = sample_frequencies(logits, 2_000, top_k=2, top_p=0.5, kernels=kernels)
    assert set(freq.nonzero().flatten().tolist()) == {0}
    freq = sample_frequencies(logits, 2_000, top_k=3, top_p=0.99, kernels=kernels)
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}


def reference_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The kept token ids, computed the obvious way in float64."""
    order = logits.double().sort(descending=True).indices.tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = logits.double()[order].softmax(-1).tolist()
    kept, mass_above = [], 0.0
    for token_id, p in zip(order, probs):
        if kept and top_p < 1.0 and mass_above >= top_p:
            break
        kept.append(token_id)
        mass_above += p
    return set(kept)


def test_top_k_top_p_matches_reference_on_wide_and_narrow_rows():
    # Flat rows need more than the 1024 candidate tokens to reach top_p (the full-sort path);
    # peaked rows do not.
    gen = torch.Generator().manual_seed(7)
    settings = [(0, 0.5), (0, 0.9), (0, 0.99), (10, 0.9), (1500, 0.95), (1500, 1.0), (3, 1.0)]
    logits, top_ks, top_ps = [], [], []
    for scale in (0.1, 1.0, 6.0):
        for top_k, top_p in settings:
            logits.append(torch.randn(3000, generator=gen) * scale)
            top_ks.append(top_k)
            top_ps.append(top_p)
    x = torch.stack(logits)
    out = _apply_top_k_top_p(x, top_ks, top_ps)
    for i in range(len(logits)):
        kept = set(out[i].isfinite().nonzero().flatten().tolist())
        assert kept == reference_top_k_top_p(x[i], top_ks[i], top_ps[i]), (i, top_ks[i], top_ps[i])
        assert torch.equal(out[i][out[i].isfinite()], x[i][out[i].isfinite()])
    assert len(set(out[0].isfinite().nonzero().flatten().tolist())) > 1024  # the wide path ran


@pytest.mark.parametrize(
    "min_p, kept", [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.35, {0, 1}), (1.0, {0})]
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p, kept, kernels):
    logits = logits_of([0.5, 0.3, 0.15, 0.05])  # thresholds: 0.125 and 0.175
    freq = sample_frequencies(logits, 4_000, min_p=min_p, kernels=kernels)
    assert set(freq.nonzero().flatten().tolist()) == kept


# -- logits processing ----------------------------------------------------------------------------


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    rows = [row(prompt=[0, 1], output=[1, 4], repetition_penalty=2.0), row()]
    out = _apply_repetition_penalty(logits, rows)
    assert out[0].tolist() == [1.0, -4.0, 1.0, -1.0, 0.25]  # seen: 0, 1, 4 (1 only once)
    assert out[1].tolist() == logits[1].tolist()


def test_frequency_and_presence_penalties_match_hand_computation():
    logits = torch.zeros(3, 5)
    rows = [
        row(prompt=[3, 3], output=[1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25),
        row(output=[4], frequency_penalty=-1.0),
        row(output=[0, 0]),
    ]
    out = _apply_frequency_presence_penalties(logits, rows)
    # prompt tokens do not count; count 3 -> 3 * 0.5 + 0.25, count 1 -> 0.5 + 0.25
    assert out[0].tolist() == [0.0, -1.75, -0.75, 0.0, 0.0]
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert out[2].tolist() == [0.0] * 5


def test_logit_bias_matches_hand_computation():
    logits = torch.zeros(2, 4)
    _add_logit_bias(logits, [row(logit_bias={1: 2.5, 3: -100}), row(logit_bias={0: 1})])
    assert logits.tolist() == [[0.0, 2.5, 0.0, -100.0], [1.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="vocab_size"):
        _add_logit_bias(torch.zeros(1, 4), [row(logit_bias={4: 1.0})])


def test_penalties_and_bias_steer_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 4)
    rows = [
        row(temperature=0),
        row(temperature=0, output=[1], repetition_penalty=2.0),  # 3 -> 1.5 < 2
        row(temperature=0, output=[1, 1], frequency_penalty=0.6),  # 3 - 1.2 = 1.8 < 2
        row(temperature=0, logit_bias={3: 2.5}),  # 1 + 2.5 = 3.5 > 3
    ]
    assert Sampler()(logits, rows).token_ids == [1, 2, 2, 3]


def test_repetition_penalty_counts_prompt_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 2)
    rows = [
        row(temperature=0, prompt=[1], repetition_penalty=2.0),
        row(temperature=0, prompt=[1], presence_penalty=2.0),
    ]
    assert Sampler()(logits, rows).token_ids == [2, 1]  # presence counts only output tokens


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 6)  # eos (0) is the argmax, then stop id 1
    rows = [
        row(temperature=0, output=[3], min_tokens=2, stop_token_ids=[1]),  # still short
        row(temperature=0, output=[3, 3], min_tokens=2, stop_token_ids=[1]),  # long enough
        row(temperature=0, output=[], min_tokens=1),  # only eos masked
        row(temperature=0, output=[], min_tokens=1, ignore_eos=True, stop_token_ids=[1]),
        row(temperature=0, output=[], min_tokens=1, eos=[0, 1, 999]),  # ids past the vocab skipped
        row(temperature=0, output=[], min_tokens=0, stop_token_ids=[1]),
    ]
    assert Sampler()(logits, rows).token_ids == [2, 0, 1, 0, 2, 0]


def test_min_tokens_applies_to_sampled_rows(kernels):
    logits = logits_of([0.9, 0.05, 0.05])
    freq = sample_frequencies(logits, 2_000, min_tokens=1, kernels=kernels)  # eos is token 0
    assert freq[0] == 0.0
    assert (freq[1:] - 0.5).abs().max() < 0.05


# -- seeds ----------------------------------------------------------------------------------------


def seeded_tokens(
    sampler: Sampler, logits: torch.Tensor, target: SamplingParams, layout: str, steps: int
) -> list[int]:
    """The target row's tokens over `steps` steps, inside a batch built according to layout."""
    tokens: list[int] = []
    gen = torch.Generator().manual_seed(len(layout))
    for step in range(steps):
        target_row = SamplingRow(target, [5, 6], list(tokens), [EOS])
        others = [
            row(temperature=0.9),
            row(temperature=1.0, seed=99, top_p=0.9),
            row(temperature=0),
            row(top_k=7, logprobs=3),
        ]
        batch_logits = torch.randn(5, logits.shape[0], generator=gen)
        if layout == "alone":
            rows, position = [target_row], 0
            batch_logits = logits[None]
        elif layout == "first":
            rows, position = [target_row] + others, 0
            batch_logits[0] = logits
        elif layout == "last":
            rows, position = others + [target_row], 4
            batch_logits[4] = logits
        else:  # "middle", no top-p neighbour (another processing path for the batch)
            rows, position = [others[0], target_row, others[3]], 1
            batch_logits = torch.stack([batch_logits[0], logits, batch_logits[1]])
        tokens.append(sampler(batch_logits, rows).token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, seed=7, top_k=50, top_p=0.95, min_p=0.01),
    ],
)
def test_seeded_row_is_independent_of_batch_and_reproducible(target, kernels):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    reference = seeded_tokens(Sampler(kernels=kernels), logits, target, "alone", 12)
    for layout in ("first", "last", "middle"):
        assert seeded_tokens(Sampler(seed=len(layout), kernels=kernels), logits, target, layout, 12) == reference
    # A fresh sampler (a restarted engine, a preempted request) gives the same tokens again.
    assert seeded_tokens(Sampler(kernels=kernels), logits, target, "alone", 12) == reference
    # The draw depends on the output position, and on the seed.
    assert len(set(reference)) > 6
    other_seed = dataclasses.replace(target, seed=8)
    assert seeded_tokens(Sampler(kernels=kernels), logits, other_seed, "alone", 12) != reference


def test_seeded_rows_sample_the_right_distribution(kernels):
    logits = torch.tensor([1.0, 0.0, 2.0, -0.5, 0.5])
    expected = logits.softmax(-1)
    num = 4_000
    rows = [row(seed=s) for s in range(num)]
    token_ids = torch.tensor(Sampler(kernels=kernels)(logits.expand(num, -1), rows).token_ids)
    freq = torch.bincount(token_ids, minlength=5).float() / num
    assert (freq - expected).abs().max() < 0.03


def test_unseeded_sampler_seed_makes_runs_repeatable(kernels):
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(5))
    rows = [row() for _ in range(64)]
    runs = [Sampler(seed=seed, kernels=kernels)(logits, rows).token_ids for seed in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def test_seeded_rows_leave_the_shared_generator_alone(kernels):
    """Unseeded rows draw the same after a step of seeded rows as without it."""
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(6))
    unseeded = [row() for _ in range(8)]
    seeded = [row(seed=s) for s in range(8)]
    sampler = Sampler(seed=3, kernels=kernels)
    sampler(logits, seeded)
    assert sampler(logits, unseeded).token_ids == Sampler(seed=3, kernels=kernels)(logits, unseeded).token_ids


def reference_sample_rows(logits, inv_temperature, min_p, keys) -> torch.Tensor:
    """sample_rows's draw in float64 PyTorch ops: U_i from murmur3's finalizer applied twice to
    (i, the key's halves), argmax of logits * inv_t - log(-log U) over the tokens min-p keeps."""
    low32 = 0xFFFFFFFF

    def mix32(h):
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & low32
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & low32
        return h ^ (h >> 16)

    index = torch.arange(logits.shape[1], dtype=torch.int64)[None]
    k0, k1 = (keys & low32)[:, None], ((keys >> 32) & low32)[:, None]
    u = ((mix32((mix32(index ^ k0) + k1) & low32) >> 8).double() + 0.5) * 2.0**-24
    x = logits.double()
    score = x * inv_temperature.double()[:, None] - (-u.log()).log()
    floor = x.amax(dim=1, keepdim=True) + min_p.double().log()[:, None] / inv_temperature.double()[:, None]
    return score.masked_fill(x < floor, float("-inf")).argmax(dim=1)


def test_sample_rows_draws_what_its_definition_says(kernels):
    """The kernel against its definition in PyTorch ops, rows of every kind: a large vocabulary
    (several of its chunks and a partial one), temperatures, min-p, -inf masks, a single allowed
    token, and keys of both signs."""
    if kernels is None:
        pytest.skip("the CPU kernels' sample_rows")
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 48, 5003
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[::5, ::3] = float("-inf")
    logits[7, :] = float("-inf")
    logits[7, 4321] = 0.0
    inv_t = 1.0 / torch.empty(rows).uniform_(0.2, 2.0, generator=gen)
    min_p = torch.where(torch.arange(rows) % 3 == 0, torch.empty(rows).uniform_(0.0, 0.5, generator=gen), 0.0)
    keys = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=gen)
    got = kernels.sample_rows(logits, inv_t, min_p, keys)
    assert got.tolist() == reference_sample_rows(logits, inv_t, min_p, keys).tolist()
    assert got[7] == 4321
    assert len(set(got.tolist())) > rows // 2  # not one token for every row
    # A row is drawn from its key and logits alone.
    assert kernels.sample_rows(logits[5:6], inv_t[5:6], min_p[5:6], keys[5:6]).tolist() == [got[5]]


# -- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_top_k(dtype):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6)).to(dtype)
    rows = [
        row(temperature=0, logprobs=5),
        row(temperature=0.5, logprobs=0, repetition_penalty=1.3, prompt=[1, 2]),
        row(temperature=0),  # did not ask
        row(temperature=2.0, top_k=4, logprobs=20, logit_bias={3: 10.0}),
    ]
    out = Sampler(seed=0)(logits, rows)
    reference = logits.float().log_softmax(dim=-1)
    for i, token_id in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], reference[i, token_id].item(), abs_tol=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    for i, k in [(0, 5), (3, 20)]:
        top = out.top_logprobs[i]
        assert len(top) == k
        values, ids = reference[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert all(math.isclose(lp, v, abs_tol=1e-5) for (_, lp), v in zip(top, values.tolist()))
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy picked the most likely


def test_logprobs_with_fewer_tokens_than_requested():
    out = Sampler()(torch.randn(1, 4), [row(temperature=0, logprobs=20)])
    assert len(out.top_logprobs[0]) == 4
