"""The prefix cache's host and disk tiers on the real default model: evicted prompts come back
from host memory and from disk, also after a restart, and the output never changes."""

from __future__ import annotations

import logging
import threading

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# Four prompts of 5 full blocks each, sharing nothing: with 12 device blocks, each evicts the
# one before last.
PROMPTS = [f"Document {i}: " + " ".join(f"{w}{i}" for w in ("alpha", "beta", "gamma", "delta", "epsilon")) * 8
           for i in range(4)]
ORDER = [0, 1, 2, 3, 0, 1, 2, 3]
FP32 = dict(dtype="float32", quantization="none")
# 12 device blocks (two prompts); 12 host slots (fp32 blocks of 0.7 MiB): the next two prompts
# push the first two down to host memory, then the next two push part of them on to disk.
TIERED = dict(FP32, num_kv_blocks=12, host_cache_gb=0.0085, max_num_batched_tokens=128)


def run(llm: LLM, order=ORDER) -> list[list[int]]:
    return [llm.generate(PROMPTS[i], GREEDY)[0].outputs[0].token_ids for i in order]


@pytest.fixture(scope="module")
def expected(default_model_path):
    with LLM(str(default_model_path), kv_cache_memory_gb=0.25, enable_prefix_caching=False, **FP32) as llm:
        assert all(len(llm.tokenizer.encode(p)) in range(81, 96) for p in PROMPTS)  # 5 full blocks + a partial
        outs = llm.generate(PROMPTS, GREEDY)
    return {i: o.outputs[0].token_ids for i, o in enumerate(outs)}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory, default_model_path, expected):
    """A disk tier written by an engine that demoted every prompt to host memory and disk."""
    path = tmp_path_factory.mktemp("kv-disk")
    threads = set(threading.enumerate())
    with LLM(str(default_model_path), disk_cache_dir=str(path), **TIERED) as llm:
        assert run(llm) == [expected[i] for i in ORDER]
        kv = llm.engine.core.kv_cache_manager
        # The second round finds every prompt evicted from the device: from the host tier, or
        # (pushed out of its 6 slots) read back from disk.
        assert kv.num_demoted_blocks > 0 and kv.num_promoted_blocks > 0
        assert kv.host_hit_blocks > 0 and kv.disk_hit_blocks > 0
        assert kv.host_tier.num_slots == 12 and kv.num_disk_written_blocks == 4 * 5  # each block once
        store = llm.engine.core.runner.disk_store
    assert set(threading.enumerate()) == threads  # the disk threads end with the engine
    assert len(list(store.dir.glob("*.kv"))) == kv.num_disk_written_blocks
    return path


def test_host_tier_alone_changes_no_output_and_promotes(default_model_path, expected):
    with LLM(str(default_model_path), **TIERED) as llm:
        assert run(llm) == [expected[i] for i in ORDER]
        kv = llm.engine.core.kv_cache_manager
    assert kv.host_hit_blocks > 0 and kv.num_promoted_blocks == kv.host_hit_blocks
    assert kv.prefix_hit_tokens == 16 * kv.host_hit_blocks  # (nothing is shared on the device)


def test_a_restarted_engine_reads_the_prefixes_from_disk(default_model_path, expected, disk_dir):
    with LLM(str(default_model_path), disk_cache_dir=str(disk_dir), **TIERED) as llm:
        assert run(llm, [2, 3]) == [expected[2], expected[3]]
        kv = llm.engine.core.kv_cache_manager
    assert kv.disk_hit_blocks == 10 and kv.disk_miss_blocks == 0  # 5 blocks each, none computed
    assert kv.prefix_hit_tokens == 10 * 16


def test_corrupted_block_files_are_misses(default_model_path, expected, disk_dir):
    files = sorted(next(disk_dir.iterdir()).glob("*.kv"))
    for i, path in enumerate(files):  # every other file a flipped byte, the others cut short
        raw = bytearray(path.read_bytes())
        if i % 2:
            raw[len(raw) // 2] ^= 0x01
        else:
            raw = raw[: len(raw) - 100]
        path.write_bytes(bytes(raw))
    with LLM(str(default_model_path), disk_cache_dir=str(disk_dir), **TIERED) as llm:
        assert run(llm, [0, 1]) == [expected[0], expected[1]]
        kv = llm.engine.core.kv_cache_manager
        store = llm.engine.core.runner.disk_store
    assert kv.disk_hit_blocks == 0 and kv.disk_miss_blocks == store.num_corrupt > 0
    assert kv.prefix_hit_tokens == 0


def test_another_kv_layout_never_reads_the_files_and_a_failing_disk_keeps_serving(default_model_path, disk_dir,
                                                                               caplog):
    # float16 KV: other bytes per block, so another identity.
    with LLM(str(default_model_path), disk_cache_dir=str(disk_dir), kv_cache_dtype="float16", **TIERED) as llm:
        store = llm.engine.core.runner.disk_store
        assert store.hashes_at_start == [] and len(list(disk_dir.iterdir())) == 2
        store.dir.rmdir()
        store.dir.write_text("")  # every write now fails, as on a full disk
        outs = run(llm)
        kv = llm.engine.core.kv_cache_manager
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert kv.disk_index is None and not store.enabled and kv.disk_hit_blocks == 0
    assert caplog.text.count("disk tier off") == 1


def test_blocks_that_never_left_the_device_are_on_disk_after_a_restart(default_model_path, expected, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.engine.engine_core")
    with LLM(str(default_model_path), disk_cache_dir=str(tmp_path), **TIERED) as llm:
        assert run(llm, [0]) == [expected[0]]
        kv = llm.engine.core.kv_cache_manager
        assert kv.num_disk_written_blocks == 0  # nothing was evicted
    assert kv.num_persisted_blocks == 5 and "5 cached blocks written" in caplog.text
    assert len(list(next(tmp_path.iterdir()).glob("*.kv"))) == 5
    with LLM(str(default_model_path), disk_cache_dir=str(tmp_path), **TIERED) as llm:
        assert run(llm, [0]) == [expected[0]]
        kv = llm.engine.core.kv_cache_manager
    assert kv.disk_hit_blocks == 5 and kv.disk_miss_blocks == 0 and kv.prefix_hit_tokens == 5 * 16
    assert kv.num_persisted_blocks == 0  # (all there already)
