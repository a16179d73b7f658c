"""Prefix caching and swapping in the core, with exact block ids and ref counts."""

from tokenmill.core.block_pool import BlockPool, hash_block
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS, FakeModel, make_scheduler

BS = 4


def req(req_id: str, tokens: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, **params), [EOS], max_tokens)


def run(kv: KVCacheManager, r: Request) -> list[int]:
    """Admit r as the scheduler does (adopt hits, allocate the rest), mark it computed."""
    hits = kv.get_computed_blocks(r)
    r.num_computed_tokens = 0
    ids = kv.allocate_slots(r, r.num_tokens - len(hits or ()) * BS, hits)
    assert ids is not None
    r.num_computed_tokens = r.num_tokens
    return kv.get_block_ids(r.request_id)


def ref_counts(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[i].ref_cnt for i in ids]


def test_hash_chain_depends_on_every_earlier_token():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h0
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"int8") != h0  # the extra key separates KV contents


def test_full_hit_after_the_first_request_finished():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens
    assert run(kv, a) == [0, 1, 2]
    kv.free(a)
    assert kv.block_pool.free_block_ids()[-3:] == [2, 1, 0]  # tail first
    b = req("b", list(range(1, 11)))
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert kv.allocate_slots(b, 2, hits) == [0, 1, 3]  # the partial block is never shared
    assert ref_counts(kv, [0, 1, 3]) == [1, 1, 1]
    assert kv.prefix_query_tokens == 20 and kv.prefix_hit_tokens == 8


def test_partial_hit_and_chain_break():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(1, 13)))  # 3 full blocks
    run(kv, a)
    b = req("b", [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13])  # differs in the second block
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == [0]
    c = req("c", [9, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # differs in the first token:
    assert kv.get_computed_blocks(c) == []  # nothing after it matches either


def test_the_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(10, BS)
    run(kv, req("a", list(range(1, 9))))  # exactly 2 full blocks
    b = req("b", list(range(1, 9)))
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == [0]  # not block 1: token 8 must run


def test_eviction_is_least_recently_freed_first():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(1, 9)))  # blocks 0, 1 (both full, both cached)
    b = req("b", list(range(20, 28)))  # blocks 2, 3
    run(kv, a)
    run(kv, b)
    kv.free(a)  # queue: 1, 0
    kv.free(b)  # queue: 1, 0, 3, 2
    assert kv.block_pool.free_block_ids() == [1, 0, 3, 2]
    c = req("c", list(range(40, 48)))  # needs 2 fresh blocks: evicts a's tail, then a's head
    assert run(kv, c) == [1, 0]
    assert kv.block_pool.num_evictions == 2
    assert kv.get_computed_blocks(req("a2", list(range(1, 10)))) == []
    assert [blk.block_id for blk in kv.get_computed_blocks(req("b2", list(range(20, 29))))] == [2, 3]


def test_a_block_held_by_running_requests_is_never_evicted():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(1, 10)))  # blocks 0, 1 full, 2 partial
    run(kv, a)
    b = req("b", list(range(1, 10)))
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits) == [0, 1, 3]
    assert ref_counts(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    kv.free(a)
    assert ref_counts(kv, [0, 1, 2]) == [1, 1, 0]
    assert kv.block_pool.free_block_ids() == [2]  # 0 and 1 stay with b
    c = req("c", list(range(50, 58)))
    assert kv.get_computed_blocks(c) == []
    assert kv.allocate_slots(c, 8) is None  # needs 2, only 1 free: b's blocks are not taken
    assert kv.block_pool.lookup(hash_block(None, [1, 2, 3, 4])) is kv.block_pool.blocks[0]


def test_hits_in_the_free_queue_count_against_free_blocks():
    kv = KVCacheManager(3, BS)
    a = req("a", list(range(1, 9)))
    run(kv, a)
    kv.free(a)  # blocks 1, 0 free and cached; block 2 free
    b = req("b", list(range(1, 9)) + [9, 10, 11, 12, 13])  # hits block 0 and 1, needs 2 more
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert kv.allocate_slots(b, 5, hits) is None  # 2 hits + 2 new > 3 blocks
    assert ref_counts(kv, [0, 1, 2]) == [0, 0, 0] and kv.block_pool.num_free_blocks == 3


def test_requests_in_one_step_share_a_new_prefix():
    s = make_scheduler(num_blocks=20, block_size=BS, budget=64, caching=True)
    fake = FakeModel(s)
    prompt = list(range(1, 13))  # 3 full blocks
    s.add_request(req("a", prompt))
    s.add_request(req("b", prompt))
    sched, _ = fake.step()
    # b adopts the two blocks a fills in this very step and computes only the rest.
    assert sched.num_scheduled_tokens == {"a": 12, "b": 4}
    a_blocks, b_blocks = s.kv.get_block_ids("a"), s.kv.get_block_ids("b")
    assert a_blocks == [0, 1, 2] and b_blocks == [0, 1, 3]
    assert ref_counts(s.kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert s.requests["b"].num_cached_tokens == 8


def test_recompute_preemption_resumes_from_its_own_cached_blocks():
    s = make_scheduler(num_blocks=5, block_size=BS, budget=16, caching=True)
    fake = FakeModel(s)
    s.add_request(req("a", list(range(1, 9)), max_tokens=8))  # 2 blocks, growing to 4
    s.add_request(req("b", list(range(30, 38)), max_tokens=8))  # 2 blocks: b is preempted
    while s.requests:
        fake.step()
    assert s.num_preemptions >= 1
    resumed = [new for st in fake.steps[1:] for new in st.scheduled_new_reqs if new.req_id == "b"]
    assert resumed and resumed[0].num_computed_tokens == 4  # its first block came back from the cache


def run_to_completion(num_blocks: int, host_blocks: int = 0):
    s = make_scheduler(num_blocks=num_blocks, block_size=BS, budget=16, host_blocks=host_blocks)
    fake = FakeModel(s)
    reqs = [req(r, [t + i for i in range(7)], max_tokens=10) for r, t in (("a", 1), ("b", 40), ("c", 80))]
    for r in reqs:
        s.add_request(r)
    while s.requests:
        fake.step()
    return s, fake.steps, [r.output_token_ids for r in reqs]


def test_swap_out_and_in_keeps_progress_and_output():
    _, _, expected = run_to_completion(num_blocks=100)
    s, steps, got = run_to_completion(num_blocks=6, host_blocks=16)
    assert got == expected
    assert s.num_swap_preemptions >= 1 and s.num_swap_preemptions == s.num_preemptions
    swapped_out = [pair for st in steps for pair in st.blocks_to_swap_out]
    swapped_in = [pair for st in steps for pair in st.blocks_to_swap_in]
    assert len(swapped_out) == len(swapped_in) == s.kv.num_swapped_out_blocks == s.kv.num_swapped_in_blocks
    # The first swap-out moves the newest request's blocks, in table order, to host blocks 0, 1, ...
    first = next(st for st in steps if st.blocks_to_swap_out)
    assert [h for _, h in first.blocks_to_swap_out] == list(range(len(first.blocks_to_swap_out)))
    (victim,) = first.preempted_req_ids
    assert victim == "c"
    # Every host block that went out comes back in; a resumed request continues where it
    # stopped, in the device blocks its host blocks were copied into.
    assert sorted(h for h, _ in swapped_in) == sorted(h for _, h in swapped_out)
    after = steps[steps.index(first) + 1:]
    back = next(st for st in after if any(n.req_id == victim for n in st.scheduled_new_reqs))
    (resumed,) = [n for n in back.scheduled_new_reqs if n.req_id == victim]
    assert resumed.num_computed_tokens > 0
    restored = {d for _, d in back.blocks_to_swap_in}
    assert set(resumed.block_ids[: len(first.blocks_to_swap_out)]) <= restored
    assert s.kv.host_pool.num_free_blocks == 16 and s.kv.block_pool.num_free_blocks == 6


def test_without_a_host_pool_preemption_recomputes_with_the_same_output():
    _, _, expected = run_to_completion(num_blocks=100)
    s, steps, got = run_to_completion(num_blocks=6)
    assert got == expected
    assert s.num_preemptions >= 1 and s.num_swap_preemptions == 0
    assert not any(st.blocks_to_swap_out or st.blocks_to_swap_in for st in steps)


def test_host_pool_too_small_falls_back_to_recompute():
    kv = KVCacheManager(4, BS, enable_caching=False, num_host_blocks=1)
    a = req("a", list(range(1, 9)))
    run(kv, a)
    assert kv.swap_out(a) is None  # 2 blocks do not fit in 1
    assert kv.get_block_ids("a") == [0, 1]


def test_block_pool_reset_cache_drops_only_free_cached_blocks():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"x" * 32)
    pool.cache_block(b, b"y" * 32)
    pool.free_blocks([a])
    assert pool.reset_cache() == 1
    assert pool.lookup(b"x" * 32) is None and pool.lookup(b"y" * 32) is b


def fork_pair(prompt_len: int, caching: bool = True):
    s = make_scheduler(num_blocks=10, block_size=BS, budget=32, caching=caching)
    fake = FakeModel(s)
    a = req("a#0", list(range(1, prompt_len + 1)))
    b = req("a#1", list(range(1, prompt_len + 1)))
    b.fork_parent = a
    s.add_request(a)
    s.add_request(b)
    return s, fake, a, b


def test_n_samples_share_the_prompt_blocks_and_copy_the_partial_one_on_write():
    s, fake, a, b = fork_pair(6, caching=False)  # blocks: [1..4] full, [5, 6] partial
    sched, _ = fake.step()
    assert sched.num_scheduled_tokens == {"a#0": 6}  # the second sample waits for the prompt
    sched, _ = fake.step()
    # a#0 decodes position 6 into its block 1; a#1 adopts blocks 0 and 1, recomputes position 5
    # for its own first token, and so writes into the shared block 1: copied to block 2 first.
    assert sched.num_scheduled_tokens == {"a#0": 1, "a#1": 1}
    assert sched.blocks_to_copy == [(1, 2)]
    (new,) = sched.scheduled_new_reqs
    assert new.block_ids == [0, 2] and new.num_computed_tokens == 5
    assert s.kv.get_block_ids("a#0") == [0, 1]
    assert ref_counts(s.kv, [0, 1, 2]) == [2, 1, 1]
    assert s.kv.num_copied_blocks == 1 and s.kv.num_forked_blocks == 2
    while s.requests:
        fake.step()
    assert b.output_token_ids == a.output_token_ids  # the fake model's tokens depend on length only
    assert s.kv.block_pool.num_free_blocks == 10


def test_a_full_shared_last_prompt_block_is_copied_too():
    s, fake, a, b = fork_pair(8)  # two full blocks, both registered in the prefix cache
    fake.step()
    sched, _ = fake.step()
    # a#0 decodes into a new block 2; a#1 recomputes position 7, in shared full block 1.
    assert sched.blocks_to_copy == [(1, 3)]
    assert s.kv.get_block_ids("a#0") == [0, 1, 2] and s.kv.get_block_ids("a#1") == [0, 3]
    assert ref_counts(s.kv, [0, 1, 2, 3]) == [2, 1, 1, 1]
    assert s.kv.block_pool.blocks[3].block_hash is None  # the copy is private until full again


def test_a_sample_whose_first_sibling_is_gone_is_admitted_normally():
    s, fake, a, b = fork_pair(9)
    fake.step()
    s.finish_requests(["a#0"], RequestStatus.FINISHED_ABORTED)
    sched, _ = fake.step()
    (new,) = sched.scheduled_new_reqs
    assert new.req_id == "a#1" and new.num_computed_tokens == 8  # two blocks from the prefix cache
    assert sched.blocks_to_copy == []


def test_a_request_that_waits_for_blocks_is_counted_in_the_prefix_stats_once():
    s = make_scheduler(num_blocks=4, block_size=BS, budget=32, caching=True)
    fake = FakeModel(s)
    s.add_request(req("a", list(range(1, 13)), max_tokens=4))  # 3 blocks, growing to 4
    s.add_request(req("b", list(range(50, 58)), max_tokens=4))  # needs 2 of the 1 left: waits for a
    fake.step()
    steps_waited = 0
    while "b" in s.requests and s.requests["b"].status == RequestStatus.WAITING:
        fake.step()
        steps_waited += 1
    assert steps_waited >= 1
    assert s.kv.prefix_query_tokens == 12 + 8  # a once, b once, however many steps b waited
