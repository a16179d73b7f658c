"""The live stats stream, `GET /stats/stream`: server-sent events of the engine's state a few
times a second, for the web page's engine view (and any other client).

Cheap by construction: the engine thread only appends one `StepRecord` a step to
`AsyncLLM.recent_steps`; each connected client's generator wakes every `interval` seconds on the
event loop, copies that deque and reads the gauges and the last minute's latency histograms.
Nothing runs per step on the event loop, and nothing at all while no client is connected.

Each event is one `data:` line of JSON (`StatsStream.snapshot`):
- `ready`, `model`; gauges `num_running`, `num_waiting`, `kv_cache_usage` (0-1), `num_blocks`,
  `num_free_blocks`, `num_host_blocks`, `num_free_host_blocks` (the swap pool);
- counters since start: `num_steps`, `num_preemptions`, `num_swapped_out_blocks`,
  `num_swapped_in_blocks`, `prefix_cache_hits` / `prefix_cache_queries` (tokens) and their
  `prefix_cache_hit_rate` (null before any lookup);
- `tiers`: the prefix cache's tiers (`tiers_snapshot`): for each of `device`, `host`, `disk`
  `{"hits", "misses", "blocks", "bytes", "capacity_bytes"}` (counters in blocks, as in
  `/metrics`; capacity 0: the tier is off), and the counters `promoted_blocks`,
  `demoted_blocks`, `disk_written_blocks`, `disk_read_blocks`, `disk_corrupt_blocks` with the
  disk threads' mean `disk_write_ms` and `disk_read_ms` per block (null before the first);
- `output_tokens_per_s`, `prompt_tokens_per_s`: over the last RATE_WINDOW seconds of steps;
- `ttft`, `itl`: `{"count", "p50_ms", "p90_ms", "p99_ms"}` over the last minute (null without one);
- `steps`: the steps since the previous event (at most MAX_STEPS_PER_EVENT, the newest), each
  `[step, prefill tokens, generated tokens, milliseconds]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from tokenmill.engine.async_llm import AsyncLLM, EngineStats, StepRecord
from tokenmill.entrypoints.openai.metrics import RecentLatencies, ServerMetrics

DEFAULT_INTERVAL = 0.5  # seconds between events
MIN_INTERVAL, MAX_INTERVAL = 0.1, 10.0
RATE_WINDOW = 5.0  # seconds of steps that tokens/s are averaged over
MAX_STEPS_PER_EVENT = 256
PERCENTILES = (0.5, 0.9, 0.99)


class StatsStream:
    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics, model_name: str):
        self.llm = llm
        self.metrics = metrics
        self.model_name = model_name

    async def events(self, interval: float, should_stop: Callable[[], bool]) -> AsyncIterator[str]:
        """SSE lines, one event now and one every `interval` seconds, until `should_stop()` (the
        server drains or the engine died) or the client leaves (the response cancels this)."""
        last_step = 0
        while not should_stop():
            snapshot = self.snapshot(since_step=last_step)
            if snapshot["steps"]:
                last_step = snapshot["steps"][-1][0]
            yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
            await asyncio.sleep(interval)

    def snapshot(self, since_step: int = 0, now: float | None = None) -> dict:
        llm, s = self.llm, self.llm.stats
        now = time.monotonic() if now is None else now
        steps = list(llm.recent_steps)  # one copy: the engine thread appends meanwhile
        prefill, generated, span = _tokens_in_window(steps, now, RATE_WINDOW, llm.recent_steps.maxlen)
        return {
            "ready": llm.ready.is_set() and llm.load_error is None and llm.dead_error is None,
            "model": self.model_name,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "num_blocks": s.num_blocks,
            "num_free_blocks": s.num_free_blocks,
            "num_host_blocks": s.num_host_blocks,
            "num_free_host_blocks": s.num_free_host_blocks,
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_swapped_out_blocks": s.num_swapped_out_blocks,
            "num_swapped_in_blocks": s.num_swapped_in_blocks,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None,
            "tiers": tiers_snapshot(s),
            "output_tokens_per_s": generated / span,
            "prompt_tokens_per_s": prefill / span,
            "ttft": _latency_summary(self.metrics.recent_ttft, now),
            "itl": _latency_summary(self.metrics.recent_itl, now),
            "steps": [[r.step, r.num_prefill_tokens, r.num_generated_tokens, round(r.seconds * 1e3, 2)]
                      for r in steps[-MAX_STEPS_PER_EVENT:] if r.step > since_step],
        }


TIERS = ("device", "host", "disk")


def tiers_snapshot(s: EngineStats) -> dict:
    """The prefix cache's tiers for the engine view: what `/metrics` reports of them."""
    tiers = {
        name: {"hits": s.tier_hits[i], "misses": s.tier_misses[i], "blocks": s.tier_blocks[i],
               "bytes": s.tier_blocks[i] * s.bytes_per_block,
               "capacity_bytes": s.tier_capacity_blocks[i] * s.bytes_per_block}
        for i, name in enumerate(TIERS)
    }
    mean_ms = lambda seconds, n: round(seconds / n * 1e3, 3) if n else None  # noqa: E731
    return {
        **tiers,
        "promoted_blocks": s.num_promoted_blocks,
        "demoted_blocks": s.num_demoted_blocks,
        "disk_written_blocks": s.num_disk_written_blocks,
        "disk_read_blocks": s.num_disk_read_blocks,
        "disk_corrupt_blocks": s.num_disk_corrupt_blocks,
        "disk_write_ms": mean_ms(s.disk_write_seconds, s.num_disk_written_blocks),
        "disk_read_ms": mean_ms(s.disk_read_seconds, s.num_disk_read_blocks),
    }


def _tokens_in_window(steps: list[StepRecord], now: float, window: float,
                      maxlen: int | None) -> tuple[int, int, float]:
    """(prefill tokens, generated tokens, seconds they span) of the steps that ended in the last
    `window` seconds; when the log is full and all of it is that recent, the seconds it covers."""
    prefill = generated = 0
    start = now - window
    for record in reversed(steps):
        if record.end_time <= start:
            return prefill, generated, window
        prefill += record.num_prefill_tokens
        generated += record.num_generated_tokens
    if steps and len(steps) == maxlen:
        first = steps[0]
        return prefill, generated, max(now - (first.end_time - first.seconds), 1e-3)
    return prefill, generated, window


def _latency_summary(latencies: RecentLatencies, now: float) -> dict | None:
    values = latencies.percentiles(PERCENTILES, now)
    if latencies.count == 0:
        return None
    summary = {"count": latencies.count}
    for q, v in zip(PERCENTILES, values):
        summary[f"p{round(q * 100)}_ms"] = round(v * 1e3, 2)
    return summary
