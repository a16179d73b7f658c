"""When requests are sent: fixed concurrency, Poisson arrivals, or a burst, bounded in count and time.

- `--concurrency C` alone: a closed loop, C requests in flight, the next sent as one finishes.
- `--request-rate R`: Poisson arrivals (exponential gaps, mean 1/R s), an open loop: a slow
  server does not slow the arrivals down. With `--concurrency C` too, at most C are in flight and
  the rest wait for a slot (their wait is not part of their latency: see `client`).
- neither (or `--request-rate inf`): a burst, every request sent at once.
No request is sent after `duration` seconds; the ones in flight then finish (each is bounded by the
request timeout), so a run always stops by itself.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenmill.bench.client import RequestResult

# send(index, scheduled_time, clock_origin) -> the finished request
SendFn = Callable[[int, float, float], Awaitable[RequestResult]]


class LoadError(ValueError):
    """A load pattern value out of range; the message names the field."""


@dataclass(frozen=True)
class LoadPattern:
    request_rate: float = math.inf
    max_concurrency: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise LoadError(f"request_rate: must be > 0 (inf for a burst), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadError(f"concurrency: must be >= 1, got {self.max_concurrency}")
        if self.duration is not None and not self.duration > 0:
            raise LoadError(f"duration: must be > 0 seconds, got {self.duration}")

    @property
    def kind(self) -> str:
        if math.isfinite(self.request_rate):
            return "poisson"
        return "concurrency" if self.max_concurrency is not None else "burst"

    def describe(self) -> str:
        if self.kind == "poisson":
            cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
            return f"Poisson {self.request_rate:g} req/s{cap}"
        return f"concurrency {self.max_concurrency}" if self.kind == "concurrency" else "burst"


def arrival_times(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is released: Poisson, or all 0 for inf."""
    if not math.isfinite(request_rate):
        return [0.0] * num_requests
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def run_load(pattern: LoadPattern, num_requests: int, send: SendFn, seed: int = 0,
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Drive `send` with the pattern. Returns the results of the requests actually sent, in index
    order, and the duration in seconds from the start to the last completion."""
    schedule = arrival_times(num_requests, pattern.request_rate, random.Random(seed))
    slots = asyncio.Semaphore(pattern.max_concurrency) if pattern.max_concurrency else None
    origin = time.perf_counter()
    deadline = origin + pattern.duration if pattern.duration else math.inf

    async def one(index: int, at: float) -> RequestResult | None:
        delay = origin + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            return await _send(index, at)
        async with slots:
            return await _send(index, at)

    async def _send(index: int, at: float) -> RequestResult | None:
        if time.perf_counter() >= deadline:
            return None  # the time bound: never sent, not counted
        result = await send(index, at, origin)
        if on_done is not None:
            on_done(result)
        return result

    tasks = [asyncio.create_task(one(i, at)) for i, at in enumerate(schedule) if origin + at < deadline]
    results = [r for r in await asyncio.gather(*tasks) if r is not None]
    return results, time.perf_counter() - origin
