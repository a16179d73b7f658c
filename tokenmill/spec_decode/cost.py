"""What verifying drafts costs, and how many drafts each request verifies in a step.

A step's time grows with the tokens it computes: t(n). One decode token reads every weight once
and is bound by memory bandwidth, so t(1 + k) / t(1) stays near 1 while the matmuls stay
bandwidth-bound and grows once they turn compute-bound (more drafts, more requests). The engine
measures t(n) at start, through the same execute_model path a verifying step takes
(`measure_step_cost`), and keeps it per model, precision and host (`StepCostCache`); what the
engine spends per step besides (`StepOverhead`) is measured as it runs and added to it.

Each request carries an estimate of its per-draft acceptance a (`AcceptanceEstimate`). With
drafts accepted one after the other, k drafts give 1 + a + a^2 + ... + a^k tokens in
expectation, so the j-th draft of a request adds a^j. `plan_drafts` hands out drafts in order of
that gain, across every request of the step, and keeps the count that gives the most expected
tokens per second of step time; with none worth it nobody speculates. The same rule works at
batch 1 and in batches: under load a step is compute-bound and drafts stop paying on their own.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenmill.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Step sizes measured at start: one request verifying n tokens, the verify sizes then a few
# more; and B requests decoding a token each. Each curve is extrapolated linearly past its last.
MEASURED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
MEASURED_BATCHES = (1, 2, 4, 8, 16, 32)
MEASURE_CONTEXT = 64  # tokens already in the cache of the measured request
MEASURE_REPEATS = 3  # the fastest of these counts (a slower run is noise, not cost)
MAX_PLANNED_DRAFTS = 256  # the most drafts whose worth one step's check weighs
MEASURE_METHOD = 2  # in the cache key: curves measured another way are measured again
CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "step-cost"


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


# --- measuring ------------------------------------------------------------------------------------

def probe_blocks(context: int, sizes: Sequence[int], block_size: int) -> int:
    """KV blocks each request of `measure_step_cost` holds: its context, the largest step, and as
    much again for the tokens its steps add."""
    return -(-(context + 2 * max(sizes)) // block_size)


class _Probes:
    """The requests `measure_step_cost` steps through the runner. Each measured step samples, as a
    real one does (logits, the LM head, sampling or verification): a request is scheduled from its
    last known token, so its known tokens grow by what each step emits; one whose next step would
    pass its blocks is replaced by a fresh one (a new prompt of `context` tokens, not timed)."""

    def __init__(self, execute_model, block_size: int, count: int, context: int, sizes: Sequence[int]):
        self.execute_model, self.context = execute_model, context
        self.blocks = probe_blocks(context, sizes, block_size)
        self.capacity = self.blocks * block_size
        self.params = SamplingParams(temperature=0.0, max_tokens=self.capacity)
        self.ids = [""] * count
        self.known = [0] * count  # the runner's known tokens of each, prompt and output
        self.serial = 0
        self._fresh(range(count))  # the prompts in one step

    def _fresh(self, indices: Sequence[int]) -> None:
        old = {self.ids[i] for i in indices if self.ids[i]}
        if old:
            self.execute_model(SchedulerOutput([], [], {}, 0, preempted_req_ids=old))
        new = []
        for i in indices:
            self.ids[i], self.serial = f"step-cost-{self.serial}", self.serial + 1
            blocks = list(range(i * self.blocks, (i + 1) * self.blocks))
            new.append(NewRequestData(self.ids[i], [0] * self.context, self.context, self.params, [], blocks, 0))
        out = self.execute_model(SchedulerOutput(new, [], {r.req_id: self.context for r in new}, self.context * len(new)))
        for i in indices:
            self.known[i] = self.context + len(out.sampled_token_ids.get(self.ids[i], ()))

    def step(self, count: int, n: int) -> SchedulerOutput:
        """The first `count` requests each verifying n tokens: its last known one and n - 1 drafts."""
        full = [i for i in range(count) if self.known[i] - 1 + n > self.capacity]
        if full:
            self._fresh(full)
        reqs = [CachedRequestData(r, [], k - 1) for r, k in zip(self.ids[:count], self.known)]
        spec = {r: [0] * (n - 1) for r in self.ids[:count]} if n > 1 else {}
        return SchedulerOutput([], reqs, {r: n for r in self.ids[:count]}, n * count, scheduled_spec_tokens=spec)

    def emitted(self, out) -> None:
        for i, r in enumerate(self.ids):
            self.known[i] += len(out.sampled_token_ids.get(r, ()))

    def close(self) -> None:  # gone from the runner as preempted requests go: no state, nothing proposed from them
        self.execute_model(SchedulerOutput([], [], {}, 0, preempted_req_ids=set(self.ids)))


def measure_step_cost(execute_model: Callable[[SchedulerOutput], object], block_size: int, sizes: Sequence[int],
                      batches: Sequence[int] = (), context: int = MEASURE_CONTEXT,
                      repeats: int = MEASURE_REPEATS) -> StepCost:
    """Time, through the runner's own execute_model, steps of one request with about `context`
    tokens in its cache verifying 1 known token + n - 1 drafts, for each n of `sizes`, and steps
    of B such requests decoding one token each, for each B of `batches`; greedy, every step
    sampling as a real one does. Runs before any request, on the first blocks of the cache
    (`probe_blocks` each; nothing holds them yet), and leaves no request state behind."""
    probes = _Probes(execute_model, block_size, max(batches, default=1), context, sizes)

    def fastest(count: int, n: int) -> float:
        times = []
        for _ in range(repeats):
            step = probes.step(count, n)
            start = time.perf_counter()
            out = execute_model(step)
            times.append(time.perf_counter() - start)
            probes.emitted(out)
        return min(times)

    try:
        seconds = [fastest(1, n) for n in sizes]
        decode_seconds = [fastest(b, 1) for b in batches]
    finally:
        probes.close()
    return StepCost(tuple(sizes), tuple(seconds), tuple(batches), tuple(decode_seconds))


class StepCostCache:
    """Measured curves on disk, one file per key (the model file, precision, device, kernels
    level, threads, parallel shape): a restart on the same setup measures nothing."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory or CACHE_DIR

    def _path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"{digest}.json"

    def get(self, key: dict) -> StepCost | None:
        try:
            data = json.loads(self._path(key).read_text())
            if data.get("key") != json.loads(json.dumps(key)):  # (as stored: tuples are lists)
                return None
            return StepCost(tuple(data["sizes"]), tuple(data["seconds"]), tuple(data.get("decode_sizes", ())),
                            tuple(data.get("decode_seconds", ())))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: dict, cost: StepCost) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "sizes": cost.sizes, "seconds": cost.seconds,
                                       "decode_sizes": cost.decode_sizes, "decode_seconds": cost.decode_seconds}))
            tmp.replace(path)
        except OSError as e:  # a read-only home costs a measurement per start, nothing else
            logger.debug("step cost not cached: %s", e)
