"""What a step costs: t(n), measured at start through the runner's own execute_model.

A step's time grows with the tokens it computes. The engine measures t(n) at start, through the
same execute_model path a verifying step takes (`measure_step_cost`), and keeps it per model,
precision and host (`StepCostCache`). The curve is a `StepCost` (core/draft_plan.py), from which
the scheduler plans how many drafts each request verifies in a step (`plan_drafts` there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenmill.core.draft_plan import StepCost
from tokenmill.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Step sizes measured at start: one request verifying n tokens, the verify sizes then a few
# more; and B requests decoding a token each. Each curve is extrapolated linearly past its last.
MEASURED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
MEASURED_BATCHES = (1, 2, 4, 8, 16, 32)
MEASURE_CONTEXT = 64  # tokens already in the cache of the measured request
MEASURE_REPEATS = 3  # the fastest of these counts (a slower run is noise, not cost)
MEASURE_METHOD = 2  # in the cache key: curves measured another way are measured again
CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "step-cost"


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
