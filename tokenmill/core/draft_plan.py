"""How many drafts each request verifies in a step, from what a step costs.

A step's time grows with the tokens it computes: t(n) (`StepCost`, measured at start by
spec_decode/cost.py). One decode token reads every weight once and is bound by memory bandwidth,
so t(1 + k) / t(1) stays near 1 while the matmuls stay bandwidth-bound and grows once they turn
compute-bound (more drafts, more requests). What the engine spends per step besides
(`StepOverhead`) is measured as it runs and added to it.

Each request carries an estimate of its per-draft acceptance a (`AcceptanceEstimate`). With
drafts accepted one after the other, k drafts give 1 + a + a^2 + ... + a^k tokens in
expectation, so the j-th draft of a request adds a^j. `plan_drafts` hands out drafts in order of
that gain, across every request of the step, and keeps the count that gives the most expected
tokens per second of step time; with none worth it nobody speculates. The same rule works at
batch 1 and in batches: under load a step is compute-bound and drafts stop paying on their own.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PLANNED_DRAFTS = 256  # the most drafts whose worth one step's check weighs


def _interpolate(sizes: Sequence[int], secs: Sequence[float], n: int) -> float:
    """Linear between measured sizes, and past the last along its last segment."""
    if n <= sizes[0] or len(sizes) == 1:
        return secs[0]
    i = min(bisect.bisect_left(sizes, n), len(sizes) - 1)  # the segment ending at the first size >= n
    lo, hi = sizes[i - 1], sizes[i]
    return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - lo) / (hi - lo)


def _check_curve(sizes: Sequence[int], seconds: Sequence[float]) -> None:
    if not sizes or sizes[0] != 1 or list(sizes) != sorted(set(sizes)):
        raise ValueError("step sizes must ascend from 1")
    if len(seconds) != len(sizes) or min(seconds) <= 0:
        raise ValueError("one positive time per size")


@dataclass(frozen=True)
class StepCost:
    """Step time at measured sizes (ascending, from 1): `seconds`, one request verifying n
    tokens (the path any step with drafts or prefill chunks takes); `decode_seconds`, B requests
    decoding one token each (the decode-only path, which batches differently), when measured.
    Each time is the fastest of its repeats (noise only slows a run) and is kept as measured: a
    larger step can be faster where the kernels change path at a row count."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    decode_sizes: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()

    def __post_init__(self):
        _check_curve(self.sizes, self.seconds)
        if self.decode_sizes:
            _check_curve(self.decode_sizes, self.decode_seconds)

    def time(self, n: int) -> float:
        """Seconds for a step of n tokens with drafts or prefill chunks."""
        return _interpolate(self.sizes, self.seconds, n)

    def decode_time(self, batch: int) -> float:
        """Seconds for a step of `batch` requests decoding one token each."""
        if not self.decode_sizes:
            return self.time(batch)
        return _interpolate(self.decode_sizes, self.decode_seconds, batch)

    def time_without_drafts(self, num_tokens: int, decode_only: bool) -> float:
        """A step of num_tokens tokens as scheduled before drafts join it: on the decode path
        when every token is a one-token decode."""
        return self.decode_time(num_tokens) if decode_only else self.time(num_tokens)

    def ratio(self, n: int) -> float:
        """t(n) / t(1)."""
        return self.time(n) / self.seconds[0]

    def describe(self, ks: Sequence[int] = (1, 2, 4, 8, 16)) -> str:
        text = ", ".join(f"k={k} {self.ratio(1 + k):.2f}" for k in ks)
        if self.decode_sizes:
            text += "; B requests decoding: " + ", ".join(
                f"B={b} {self.decode_time(b) / self.seconds[0]:.2f}" for b in self.decode_sizes if b > 1)
        return text


class AcceptanceEstimate:
    """A request's per-draft acceptance: the fraction of drafts accepted, counting the first
    rejected draft of a verification (the ones after it were never tested), over recent
    verifications (older ones decay), starting from a prior."""

    __slots__ = ("accepted", "tested")
    DECAY = 0.8
    PRIOR = 0.5
    PRIOR_WEIGHT = 2.0

    def __init__(self, prior: float | None = None):
        self.accepted = (self.PRIOR if prior is None else prior) * self.PRIOR_WEIGHT
        self.tested = self.PRIOR_WEIGHT

    def update(self, num_drafts: int, num_accepted: int) -> None:
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = self.DECAY * self.accepted + num_accepted
        self.tested = self.DECAY * self.tested + tested

    @property
    def value(self) -> float:
        return min(self.accepted / self.tested, 0.999)


def plan_drafts(cost: StepCost, num_tokens: int, num_sampled: int, candidates: Sequence[tuple[float, int]],
                overhead: float = 0.0, decode_only: bool = False) -> list[int]:
    """Drafts to verify for each candidate (acceptance a, at most m drafts) in a step of
    num_tokens tokens without drafts that samples num_sampled requests (`decode_only`: all of
    them one-token decodes, which run the decode path until a draft joins): the number that
    maximises expected tokens per second of step time (the forward's plus the engine's own
    `overhead` per step), handed out by expected gain."""
    gains: list[float] = []
    owners: list[int] = []
    heap = [(-a, i, 1) for i, (a, m) in enumerate(candidates) if m > 0 and a > 0]
    heapq.heapify(heap)
    while heap:  # the marginal gains, largest first: a^j for the j-th draft of a request
        neg_gain, i, j = heapq.heappop(heap)
        gains.append(-neg_gain)
        owners.append(i)
        a, m = candidates[i]
        if j < m:
            heapq.heappush(heap, (-(a ** (j + 1)), i, j + 1))
    base = cost.time_without_drafts(num_tokens, decode_only)
    best, best_rate, expected = 0, num_sampled / (base + overhead), float(num_sampled)
    for count, gain in enumerate(gains, 1):
        expected += gain
        rate = expected / (cost.time(num_tokens + count) + overhead)
        if rate > best_rate:
            best, best_rate = count, rate
    ks = [0] * len(candidates)
    for i in owners[:best]:
        ks[i] += 1
    return ks


def worth_drafting(cost: StepCost, num_tokens: int, num_sampled: int, max_drafts: int, overhead: float = 0.0,
                   decode_only: bool = False) -> bool:
    """Whether drafts sure to be accepted would pay in such a step: any count up to max_drafts
    (one draft may not pay where four do: a kernel can change path at a row count). Along one
    linear piece of the curve (T + k) / (t(n + k) + overhead) only rises or only falls, so the
    counts weighed are the pieces' ends: 1, max_drafts, and those that reach a measured size."""
    if num_sampled <= 0 or max_drafts < 1:
        return False
    base = cost.time_without_drafts(num_tokens, decode_only) + overhead
    counts = {1, max_drafts} | {s - num_tokens for s in cost.sizes if num_tokens < s < num_tokens + max_drafts}
    return any((num_sampled + k) * base > num_sampled * (cost.time(num_tokens + k) + overhead) for k in counts)


class StepOverhead:
    """What the engine spends per step outside the forward pass (scheduling, sampling's host
    side, output processing, the gap to the next step while requests run): an exponential
    average over busy steps, added to t(n) when drafts are planned."""

    __slots__ = ("seconds", "_last_end")
    WEIGHT = 0.1  # of the newest step
    MAX_GAP = 0.05  # a longer gap between steps is idleness, not overhead

    def __init__(self):
        self.seconds = 0.0
        self._last_end: float | None = None

    def record(self, start: float, forward_seconds: float, end: float) -> None:
        """One step from `start` to `end`, of which `forward_seconds` in execute_model."""
        gap = start - self._last_end if self._last_end is not None else 0.0
        spent = end - start - forward_seconds + (gap if gap < self.MAX_GAP else 0.0)
        self.seconds += self.WEIGHT * (max(spent, 0.0) - self.seconds)
        self._last_end = end

