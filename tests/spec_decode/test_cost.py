"""The verify-cost model: the step-time curve, the acceptance estimate, the plan of drafts per
step (core/draft_plan.py), and the curve's cache (spec_decode/cost.py). Pure Python; the
measurement on a real model is in tests/engine/test_step_cost.py."""

import json

import pytest

from tokenmill.core.draft_plan import AcceptanceEstimate, StepCost, StepOverhead, plan_drafts, worth_drafting
from tokenmill.spec_decode.cost import StepCostCache

# bandwidth-bound up to 8 tokens (each extra token costs 2% of one), compute-bound after
FLAT = StepCost((1, 8, 16, 32), (10.0, 11.4, 19.4, 35.4))


def test_step_time_interpolates_and_extrapolates():
    assert FLAT.time(1) == 10.0
    assert FLAT.time(4) == pytest.approx(10.6)
    assert FLAT.time(64) == pytest.approx(35.4 + 32 * 1.0)  # the last segment's slope
    assert FLAT.ratio(8) == pytest.approx(1.14)
    dip = StepCost((1, 2, 3), (10.0, 12.0, 11.0))  # kernels that change path at 3 rows: kept as measured
    assert dip.time(3) == 11.0
    with pytest.raises(ValueError):
        StepCost((2, 4), (1.0, 2.0))


def test_the_engines_own_overhead_per_step_makes_drafts_cheaper():
    steep = StepCost((1, 2), (10.0, 14.0))  # a draft costs 40% of the forward
    assert plan_drafts(steep, 1, 1, [(0.35, 1)]) == [0]
    # with 10 of overhead per step the draft costs 20% of the step: at a = 0.35 it pays
    assert plan_drafts(steep, 1, 1, [(0.35, 1)], overhead=10.0) == [1]
    assert not worth_drafting(StepCost((1, 2), (10.0, 30.0)), 1, 1, 1)
    assert worth_drafting(StepCost((1, 2), (10.0, 30.0)), 1, 1, 1, overhead=20.0)
    over = StepOverhead()
    over.record(start=0.0, forward_seconds=0.008, end=0.010)  # 2 ms outside the forward
    over.record(start=0.011, forward_seconds=0.008, end=0.021)  # and a 1 ms gap before it
    assert over.seconds == pytest.approx(0.1 * 0.9 * 0.002 + 0.1 * 0.003)
    over.record(start=5.0, forward_seconds=0.008, end=5.010)  # after idling: the gap is not overhead
    assert over.seconds < 0.001


def test_acceptance_estimate_follows_recent_verifications():
    est = AcceptanceEstimate(0.5)
    assert est.value == 0.5
    for _ in range(10):
        est.update(4, 4)  # all accepted: nothing rejected was tested
    assert est.value > 0.95
    for _ in range(10):
        est.update(4, 0)  # the first draft rejected: one tested, none accepted
    assert est.value < 0.35
    for _ in range(10):
        est.update(4, 0)
    assert est.value < 0.1


def test_drafts_go_where_they_are_expected_to_pay():
    # one request, bandwidth-bound: at a = 0.9 every draft up to the cap pays...
    assert plan_drafts(FLAT, 1, 1, [(0.9, 6)]) == [6]
    # ...but not the 8th, past the bend (9% more time for 0.9^8 = 0.43 more of 5.7 tokens)
    assert plan_drafts(FLAT, 1, 1, [(0.9, 12)]) == [7]
    # a = 0.1: the first draft adds 0.1 tokens for 2% more time (pays), the second 0.01 for 2% (does not)
    assert plan_drafts(FLAT, 1, 1, [(0.1, 8)]) == [1]
    # a steep curve (each draft costs 40% of a step): only a likely draft pays
    steep = StepCost((1, 2, 9), (10.0, 14.0, 42.0))
    assert plan_drafts(steep, 1, 1, [(0.3, 4)]) == [0]
    assert plan_drafts(steep, 1, 1, [(0.8, 4)])[0] >= 1
    # two requests share the step: the better one gets the drafts first
    ks = plan_drafts(FLAT, 2, 2, [(0.9, 4), (0.2, 4)])
    assert ks[0] == 4 and ks[0] > ks[1]
    # no candidates, no drafts
    assert plan_drafts(FLAT, 4, 4, []) == []


def test_a_compute_bound_step_gets_no_drafts():
    # 32 decoding requests on the compute-bound part: one more token costs 1/35 of the step and
    # brings at most 1/32 more tokens, at a = 0.5 half of that
    assert plan_drafts(FLAT, 32, 32, [(0.5, 4)] * 32) == [0] * 32
    assert worth_drafting(FLAT, 1, 1, 4)
    assert not worth_drafting(StepCost((1, 2), (10.0, 30.0)), 1, 1, 4)  # a draft triples the step
    # one draft does not pay where four do (a kernel that is slow at 2 rows): speculation stays on
    dip = StepCost((1, 2, 5), (10.0, 22.0, 15.0))
    assert not worth_drafting(dip, 1, 1, 1) and worth_drafting(dip, 1, 1, 4)
    assert plan_drafts(dip, 1, 1, [(0.5, 4)]) == [4]


def test_a_batch_of_decodes_is_priced_on_the_decode_path():
    # 16 requests decoding cost 1.5 steps of one on the decode path; the same 16 tokens as a
    # verifying chunk cost 2.8, and 32 cost 4: drafts look cheap against the chunk, not against
    # the decode-only step they would turn the step into one of
    cost = StepCost((1, 2, 16, 32), (1.0, 1.5, 2.8, 4.0), (1, 16), (1.0, 1.5))
    assert cost.decode_time(16) == 1.5 and cost.time(16) == 2.8
    candidates = [(0.6, 1)] * 16
    assert plan_drafts(cost, 16, 16, candidates, decode_only=True) == [0] * 16
    assert sum(plan_drafts(cost, 16, 16, candidates, decode_only=False)) > 0
    assert not worth_drafting(cost, 16, 16, 64, decode_only=True)
    # one request: its decode and its chunk are the same step
    assert plan_drafts(cost, 1, 1, [(0.9, 1)], decode_only=True) == [1]


def test_cache_round_trip_and_key_mismatch(tmp_path):
    cache = StepCostCache(tmp_path)
    key = {"model": "m", "dtype": "bfloat16"}
    assert cache.get(key) is None
    cache.put(key, FLAT)
    assert cache.get(key) == FLAT
    both = StepCost((1, 2), (1.0, 1.5), (1, 4), (1.0, 1.2))
    cache.put(key, both)
    assert cache.get(key) == both
    assert cache.get({**key, "dtype": "float32"}) is None
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")  # a torn file is a miss
    assert cache.get(key) is None
    path.write_text(json.dumps({"key": key, "sizes": [1, 2], "seconds": [1.0]}))
    assert cache.get(key) is None


def test_weighing_the_curves_corners_is_weighing_every_count():
    """worth_drafting looks only where the piecewise-linear curve bends: the same answer as
    trying every draft count, on random curves with dips."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        sizes = sorted({1, *rng.sample(range(2, 40), rng.randint(1, 8))})
        cost = StepCost(tuple(sizes), tuple(rng.uniform(1.0, 6.0) for _ in sizes),
                        (1, 8), (rng.uniform(0.5, 2.0), rng.uniform(1.0, 4.0)))
        n, t, m = rng.randint(1, 30), rng.randint(1, 8), rng.randint(1, 40)
        over, decode_only = rng.choice((0.0, 0.5)), rng.random() < 0.5
        base = cost.time_without_drafts(n, decode_only) + over
        every = any((t + k) * base > t * (cost.time(n + k) + over) for k in range(1, m + 1))
        assert worth_drafting(cost, n, t, m, over, decode_only) == every
