"""The prefix cache's tiers in /metrics: the engine's stats as Prometheus samples, per tier."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.async_llm import EngineStats
from tokenmill.entrypoints.openai.metrics import _EngineCounters


def test_tier_counters_gauges_and_disk_latencies():
    stats = EngineStats(bytes_per_block=1000, tier_hits=(7, 3, 2), tier_misses=(5, 2, 1), tier_blocks=(10, 4, 9),
                        tier_capacity_blocks=(12, 6, 100), num_promoted_blocks=3, num_demoted_blocks=8,
                        num_disk_written_blocks=9, num_disk_read_blocks=3, num_disk_corrupt_blocks=1,
                        disk_write_seconds=0.5, disk_read_seconds=0.25)
    registry = CollectorRegistry()
    registry.register(_EngineCounters(SimpleNamespace(stats=stats, config=SimpleNamespace(speculative_method=None)), "m"))
    samples = {(s.name, s.labels.get("tier")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    for i, tier in enumerate(("device", "host", "disk")):
        assert samples["tokenmill_prefix_cache_tier_hits_total", tier] == stats.tier_hits[i]
        assert samples["tokenmill_prefix_cache_tier_misses_total", tier] == stats.tier_misses[i]
        assert samples["tokenmill_prefix_cache_tier_blocks", tier] == stats.tier_blocks[i]
        assert samples["tokenmill_prefix_cache_tier_bytes", tier] == 1000 * stats.tier_blocks[i]
        assert samples["tokenmill_prefix_cache_tier_capacity_bytes", tier] == 1000 * stats.tier_capacity_blocks[i]
    assert samples["tokenmill_prefix_cache_promotions_total", None] == 3
    assert samples["tokenmill_prefix_cache_demotions_total", None] == 8
    assert samples["tokenmill_prefix_cache_disk_corrupt_blocks_total", None] == 1
    assert samples["tokenmill_prefix_cache_disk_write_seconds_count", None] == 9
    assert samples["tokenmill_prefix_cache_disk_write_seconds_sum", None] == 0.5
    assert samples["tokenmill_prefix_cache_disk_read_seconds_sum", None] == 0.25
