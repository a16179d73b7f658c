"""A sliding-window model's KV blocks: those no later query of a request can see go back to the
pool as it advances, a gap keeping the table's positions, and nothing else changes."""

from tokenmill.core.kv_cache_manager import WINDOW_GAP, KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS

BS = 4


def req(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=64), [EOS], 64)


def step(kv: KVCacheManager, r: Request, num_new: int) -> None:
    assert kv.allocate_slots(r, num_new) is not None
    r.num_computed_tokens += num_new


def test_blocks_before_the_window_are_freed_as_the_request_advances():
    kv = KVCacheManager(16, BS, enable_caching=False, sliding_window=6)
    r = req("a", 10)
    step(kv, r, 10)  # prefill: its first query is at position 0 and sees every block
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 13
    for _ in range(3):  # decodes at positions 10, 11, 12: the oldest key seen is 5, 6, 7
        r.append_output_token(7)
        step(kv, r, 1)
    # the query at position 12 sees keys 7..12: block 0 (keys 0-3) is left behind, block 1 (4-7) not
    blocks = kv.req_to_blocks["a"]
    assert blocks[0] is WINDOW_GAP and blocks[1] is not WINDOW_GAP
    assert kv.num_window_freed_blocks == 1 and kv.num_free_blocks == 16 - 3 - 1 + 1
    kv.free(r)  # the gap is not freed twice
    assert kv.num_free_blocks == 16


def test_without_a_window_nothing_is_freed_early():
    kv = KVCacheManager(16, BS, enable_caching=False)
    r = req("a", 30)
    step(kv, r, 30)
    r.append_output_token(7)
    step(kv, r, 1)
    assert WINDOW_GAP not in kv.req_to_blocks["a"] and kv.num_window_freed_blocks == 0


def test_a_request_with_gaps_is_not_swapped_out():
    kv = KVCacheManager(16, BS, enable_caching=False, num_host_blocks=16, sliding_window=4)
    r = req("a", 12)
    step(kv, r, 8)
    step(kv, r, 4)  # the chunk at positions 8-11 sees keys from 5 on: block 0 is freed
    assert kv.req_to_blocks["a"][0] is WINDOW_GAP
    assert kv.swap_out(r) is None  # recomputed instead: a gap has nothing to move
