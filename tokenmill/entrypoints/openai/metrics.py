"""Prometheus metrics of the server (`GET /metrics`) and the per-request completion log line.

Latencies are histograms observed per request; token counts and finished requests are
counters (rates come from `rate()` in Prometheus, never from per-batch gauges). Engine state
(running/waiting requests, KV-cache usage, preemptions) is read from the engine's stats when
the endpoint is scraped. TTFT and inter-token latency are also kept for the last minute
(`RecentLatencies`), whose percentiles the live stats stream shows.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.outputs import RequestOutput

logger = logging.getLogger("tokenmill.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 320.0)


class RecentLatencies:
    """Latencies observed in the last `window` seconds, for their percentiles.

    A histogram of log-spaced buckets (BUCKETS_PER_OCTAVE to a doubling from MIN_SECONDS; smaller
    values fall in the first, larger in the last) kept per second of arrival: `observe` is O(1),
    `percentiles` walks one running total, memory is bounded whatever the rate, and a percentile
    comes back as its bucket's middle, within 2.2% of the exact one. Not thread-safe: use it from
    one thread (the server's event loop)."""

    MIN_SECONDS = 1e-4
    BUCKETS_PER_OCTAVE = 16
    NUM_BUCKETS = 24 * BUCKETS_PER_OCTAVE  # up to MIN_SECONDS x 2**24: 28 minutes

    def __init__(self, window: float = 60.0):
        self.window = window
        self.count = 0  # observations in the window (as of the last observe or percentiles call)
        self._total = [0] * self.NUM_BUCKETS
        self._seconds: deque[tuple[int, list[int]]] = deque()  # (second of arrival, its bucket counts), oldest first

    def observe(self, seconds: float, now: float | None = None) -> None:
        second = math.floor(time.monotonic() if now is None else now)
        if not self._seconds or self._seconds[-1][0] != second:
            self._expire(second)
            self._seconds.append((second, [0] * self.NUM_BUCKETS))
        i = self.bucket(seconds)
        self._seconds[-1][1][i] += 1
        self._total[i] += 1
        self.count += 1

    def percentiles(self, qs: tuple[float, ...], now: float | None = None) -> list[float | None]:
        """The q-quantiles (0 < q <= 1, nearest rank) of the window's latencies, each the middle
        of its bucket; None for each when the window is empty."""
        self._expire(math.floor(time.monotonic() if now is None else now))
        if self.count == 0:
            return [None] * len(qs)
        ranks = [max(1, math.ceil(q * self.count)) for q in qs]
        found: dict[int, float] = {}
        seen = 0
        for i, c in enumerate(self._total):
            seen += c
            for rank in ranks:
                if rank not in found and seen >= rank:
                    found[rank] = self.bucket_middle(i)
            if len(found) == len(set(ranks)):
                break
        return [found[rank] for rank in ranks]

    @classmethod
    def bucket(cls, seconds: float) -> int:
        if seconds <= cls.MIN_SECONDS:
            return 0
        return min(cls.NUM_BUCKETS - 1, int(math.log2(seconds / cls.MIN_SECONDS) * cls.BUCKETS_PER_OCTAVE))

    @classmethod
    def bucket_middle(cls, i: int) -> float:
        return cls.MIN_SECONDS * 2 ** ((i + 0.5) / cls.BUCKETS_PER_OCTAVE)

    def _expire(self, second: int) -> None:
        while self._seconds and self._seconds[0][0] <= second - self.window:
            _, counts = self._seconds.popleft()
            for i, c in enumerate(counts):
                if c:
                    self._total[i] -= c
                    self.count -= c


class ServerMetrics:
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def histogram(name, doc):
            return Histogram(name, doc, labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model_name)

        self.ttft = histogram("tokenmill_time_to_first_token_seconds", "Time from arrival to the first output token")
        self.itl = histogram("tokenmill_inter_token_latency_seconds", "Time between successive output tokens")
        self.recent_ttft = RecentLatencies()  # the same observations, for the last minute's percentiles
        self.recent_itl = RecentLatencies()
        self.tpot = histogram("tokenmill_time_per_output_token_seconds",
                              "Per request: decode time / (output tokens - 1)")
        self.e2e = histogram("tokenmill_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue = histogram("tokenmill_request_queue_time_seconds", "Time from arrival to first scheduled")
        self.prefill = histogram("tokenmill_request_prefill_time_seconds", "Time from first scheduled to first token")
        self.decode = histogram("tokenmill_request_decode_time_seconds", "Time from first token to last token")
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "Output tokens of finished requests",
                                         labels, registry=r).labels(model_name)
        self.accepted = Counter("tokenmill_request_accepted", "Choices the engine accepted (a request of n counts n); "
                                "once every request has ended, the sum of tokenmill_request_success", labels,
                                registry=r).labels(model_name)
        self._finished = Counter("tokenmill_request_success", "Finished choices by finish reason (abort: the client "
                                 "left or the engine failed before the end)", ["model_name", "finished_reason"],
                                 registry=r)
        self.finished = lambda reason: self._finished.labels(model_name, reason)
        for reason in ("stop", "length", "abort"):
            self.finished(reason)  # present from the start, at 0
        gauges = [
            ("tokenmill_num_requests_running", "Sequences in the running batch", lambda: llm.stats.num_running),
            ("tokenmill_num_requests_waiting", "Sequences waiting to be scheduled", lambda: llm.stats.num_waiting),
            ("tokenmill_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", lambda: llm.stats.kv_cache_usage),
            # Exact block counts: an idle server has all of its blocks free (a leak shows here).
            ("tokenmill_kv_cache_free_blocks", "KV-cache blocks free (cached prefixes included)",
             lambda: llm.stats.num_free_blocks),
            ("tokenmill_kv_cache_blocks", "KV-cache blocks in all", lambda: llm.stats.num_blocks),
            ("tokenmill_kv_cache_free_host_blocks", "Host blocks for swapping that are free",
             lambda: llm.stats.num_free_host_blocks),
            ("tokenmill_kv_cache_host_blocks", "Host blocks for swapping in all", lambda: llm.stats.num_host_blocks),
            ("tokenmill_num_requests_open", "Engine requests the server holds a stream for (accepted, not yet "
             "finished or released)", lambda: llm.num_unfinished),
        ]
        for name, help_text, read in gauges:
            Gauge(name, help_text, labels, registry=r).labels(model_name).set_function(read)
        r.register(_EngineCounters(llm, model_name))


class _EngineCounters:
    """Cumulative engine counters, read at scrape time."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm = llm
        self.model_name = model_name

    def collect(self):
        s = self.llm.stats
        yield from self._speculation(s)
        yield from self._tiers(s)
        for name, doc, value in (
            ("tokenmill_num_preemptions", "Requests preempted (KV cache full)", s.num_preemptions),
            ("tokenmill_engine_steps", "Engine iterations run", s.num_steps),
            ("tokenmill_engine_generated_tokens", "Tokens generated by engine steps, aborted requests' included",
             s.num_generation_tokens),
            ("tokenmill_prefill_tokens", "Tokens prefilled, including recomputation after preemption",
             s.num_prompt_tokens),
            ("tokenmill_prefix_cache_queries", "Tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("tokenmill_prefix_cache_hits", "Tokens found in the prefix cache (not computed)", s.prefix_cache_hits),
            ("tokenmill_prefix_cache_evictions", "Cached KV blocks evicted for new contents", s.prefix_cache_evictions),
            ("tokenmill_swapped_out_blocks", "KV blocks swapped out to host memory", s.num_swapped_out_blocks),
            ("tokenmill_swapped_in_blocks", "KV blocks swapped back in from host memory", s.num_swapped_in_blocks),
            ("tokenmill_swapped_out_bytes", "Bytes of KV swapped out to host memory",
             s.num_swapped_out_blocks * s.bytes_per_block),
            ("tokenmill_swapped_in_bytes", "Bytes of KV swapped back in", s.num_swapped_in_blocks * s.bytes_per_block),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def _tiers(self, s):
        """The prefix cache's tiers (device, host, disk), labelled by tier, in blocks and bytes."""
        labels = ["model_name", "tier"]
        tiers = ("device", "host", "disk")
        for kind, name, doc, values in (
            (CounterMetricFamily, "tokenmill_prefix_cache_tier_hits", "Prefix-cache blocks found in the tier "
             "(host: blocks promoted, those read back from disk included; disk: blocks read back)", s.tier_hits),
            (CounterMetricFamily, "tokenmill_prefix_cache_tier_misses", "Prefix-cache blocks looked up and not found "
             "in the tier (host: of the device's misses; disk: reads that failed)", s.tier_misses),
            (GaugeMetricFamily, "tokenmill_prefix_cache_tier_blocks", "Prefix-cache blocks held by the tier",
             s.tier_blocks),
            (GaugeMetricFamily, "tokenmill_prefix_cache_tier_bytes", "Bytes of prefix-cache blocks held by the tier",
             tuple(n * s.bytes_per_block for n in s.tier_blocks)),
            (GaugeMetricFamily, "tokenmill_prefix_cache_tier_capacity_bytes", "Bytes of blocks the tier can hold",
             tuple(n * s.bytes_per_block for n in s.tier_capacity_blocks)),
        ):
            family = kind(name, doc, labels=labels)
            for tier, value in zip(tiers, values):
                family.add_metric([self.model_name, tier], value)
            yield family
        for name, doc, value in (
            ("tokenmill_prefix_cache_promotions", "Prefix-cache blocks copied from the host tier into the KV cache",
             s.num_promoted_blocks),
            ("tokenmill_prefix_cache_demotions", "Prefix-cache blocks evicted from the KV cache and kept in the host "
             "tier", s.num_demoted_blocks),
            ("tokenmill_prefix_cache_disk_written_blocks", "Prefix-cache blocks written to disk", s.num_disk_written_blocks),
            ("tokenmill_prefix_cache_disk_read_blocks", "Prefix-cache blocks read back from disk", s.num_disk_read_blocks),
            ("tokenmill_prefix_cache_disk_corrupt_blocks", "Block files found torn or corrupted (deleted, read as misses)",
             s.num_disk_corrupt_blocks),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, count, seconds in (
            ("tokenmill_prefix_cache_disk_write_seconds", "Time to write one block file (background thread)",
             s.num_disk_written_blocks, s.disk_write_seconds),
            ("tokenmill_prefix_cache_disk_read_seconds", "Time to read and check one block file (background thread)",
             s.num_disk_read_blocks, s.disk_read_seconds),
        ):
            family = SummaryMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], count_value=count, sum_value=seconds)
            yield family

    def _speculation(self, s):
        """Speculative decoding's counters, labelled with the engine's method ("none" when off),
        and the mean acceptance length as vLLM and llama.cpp define it: tokens emitted per
        verification, 1 + accepted drafts / verifications (1 before any)."""
        labels, values = ["model_name", "method"], [self.model_name, self.llm.config.speculative_method or "none"]
        for name, doc, value in (
            ("tokenmill_spec_decode_num_drafts", "Speculative verifications (a request verifying drafts in a step)",
             s.spec_drafts),
            ("tokenmill_spec_decode_num_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens),
            ("tokenmill_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", s.spec_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        family = CounterMetricFamily("tokenmill_spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative draft tokens accepted, by position in the draft",
                                     labels=[*labels, "position"])
        for position, value in enumerate(s.spec_accepted_per_position):
            family.add_metric([*values, str(position)], value)
        yield family
        family = GaugeMetricFamily("tokenmill_spec_decode_mean_acceptance_length",
                                   "Tokens emitted per speculative verification: 1 + accepted drafts / verifications",
                                   labels=labels)
        family.add_metric(values, 1 + s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else 1.0)
        yield family


class RequestTracker:
    """Follows one engine request's outputs into the metrics; logs one line when it ends."""

    def __init__(self, metrics: ServerMetrics, request_id: str, choices: int = 1):
        self.m = metrics
        self.request_id = request_id
        self.choices = choices
        self.last: RequestOutput | None = None
        self._last_token_time: float | None = None
        self._closed = False

    def observe(self, out: RequestOutput) -> None:
        t = out.metrics
        if t.first_token_time is not None:
            if self._last_token_time is None:
                ttft = t.first_token_time - t.arrival_time
                self.m.ttft.observe(ttft)
                self.m.recent_ttft.observe(ttft)
            elif t.last_token_time > self._last_token_time:
                new = max((len(c.delta_token_ids) for c in out.outputs), default=1) or 1
                gap = (t.last_token_time - self._last_token_time) / new
                for _ in range(new):
                    self.m.itl.observe(gap)
                    self.m.recent_itl.observe(gap)
            self._last_token_time = t.last_token_time
        self.last = out

    def close(self) -> None:
        """The request finished, or was aborted (the client left) if its last output is not final."""
        if self._closed:
            return
        self._closed = True
        out = self.last
        m = self.m
        if out is None or not out.finished:
            m.finished("abort").inc(self.choices)
            logger.info("request %s: aborted after %d output tokens", self.request_id,
                        0 if out is None else sum(len(c.token_ids) for c in out.outputs))
            return
        t = out.metrics
        end = t.finished_time or time.monotonic()
        num_out = sum(len(c.token_ids) for c in out.outputs)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(num_out)
        for c in out.outputs:
            m.finished(c.finish_reason or "abort").inc()
        m.e2e.observe(end - t.arrival_time)
        if t.first_scheduled_time is not None:
            m.queue.observe(t.first_scheduled_time - t.arrival_time)
            if t.first_token_time is not None:
                m.prefill.observe(t.first_token_time - t.first_scheduled_time)
        if t.first_token_time is not None:
            m.decode.observe(end - t.first_token_time)
            longest = max(len(c.token_ids) for c in out.outputs)
            if longest > 1:
                m.tpot.observe((end - t.first_token_time) / (longest - 1))
        ttft = (t.first_token_time - t.arrival_time) * 1e3 if t.first_token_time else float("nan")
        logger.info(
            "request %s: %d prompt + %d output tokens, TTFT %.0f ms, total %.0f ms, finish %s",
            self.request_id, len(out.prompt_token_ids), num_out, ttft, (end - t.arrival_time) * 1e3,
            ",".join(str(c.finish_reason) for c in out.outputs),
        )
