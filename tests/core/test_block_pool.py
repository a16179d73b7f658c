"""BlockPool and KVCacheManager: exact block ids, ref counts and free-queue order."""

import pytest

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(req_id: str, num_prompt: int, max_tokens: int = 8) -> Request:
    return Request(req_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens), [0], max_tokens)


def test_new_blocks_come_from_the_front_with_ref_count_one():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4]
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.6)


def test_freed_blocks_join_the_back_in_the_order_given():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(1)  # 2
    pool.free_blocks(a[::-1])
    assert pool.free_block_ids() == [3, 1, 0]
    pool.free_blocks(b)
    assert pool.free_block_ids() == [3, 1, 0, 2]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [3, 1]


def test_shared_block_is_free_only_when_the_last_reference_goes():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    blk.ref_cnt += 1  # a second holder
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.free_block_ids() == [1]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_block_ids() == [1, 0]


def test_over_asking_and_double_free_are_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


def test_allocate_slots_takes_blocks_only_for_scheduled_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    req = make_request("a", num_prompt=6)
    assert kv.allocate_slots(req, 6) == [0, 1]  # 6 tokens -> 2 blocks, none for future tokens
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1) == []  # token 7 fits in block 1
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == [2]  # token 9 opens block 2
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7


def test_allocate_slots_changes_nothing_when_short_of_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    a, b = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    req = make_request("a", 6)
    kv.allocate_slots(req, 6)
    kv.free(req)
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_core_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, tokenmill.core.scheduler, tokenmill.core.kv_cache_manager; assert 'torch' not in sys.modules, 'core imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
