"""AsyncLLM (the serving engine) on the real model with a KV cache far too small for its load:
every request completes with the output of an ample cache, and the Prometheus registry shows
the preemptions, swaps and prefix-cache hits."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.metrics import ServerMetrics

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# A shared first block (16+ tokens), then a distinct ending.
PROMPTS = [f"The quick brown fox jumps over the lazy dog near the river bank. Item {i} of the list is" for i in range(6)]


def test_small_cache_under_load_completes_everything_and_shows_it_in_metrics(default_model_path):
    expected = [o.outputs[0].token_ids for o in LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25).generate(PROMPTS, PARAMS)]
    config = EngineConfig(model=str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=6, num_host_kv_blocks=3,
                          max_num_batched_tokens=64)

    async def serve():
        llm = AsyncLLM(config, log_stats_interval=0)
        metrics = ServerMetrics(llm, "m")
        llm.start()
        await llm.wait_ready()

        async def one(i):
            final = None
            async for out in await llm.add_request(f"r{i}", PROMPTS[i], PARAMS):
                final = out
            return final.outputs[0].token_ids

        try:
            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), llm, metrics
        finally:
            llm.shutdown()

    got, llm, metrics = asyncio.run(serve())
    assert got == expected
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in f.samples}
    assert samples["tokenmill_num_preemptions_total"] > 0
    assert samples["tokenmill_swapped_out_blocks_total"] > 0
    assert samples["tokenmill_swapped_out_bytes_total"] == samples["tokenmill_swapped_out_blocks_total"] * (
        llm.stats.bytes_per_block)
    assert samples["tokenmill_prefix_cache_hits_total"] >= 16 * (len(PROMPTS) - 1)  # the shared first block
    assert samples["tokenmill_num_requests_running"] == 0 and samples["tokenmill_kv_cache_usage_perc"] == 0
