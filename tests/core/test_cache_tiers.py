"""The prefix cache's host and disk tiers in the core: which blocks are demoted, promoted, written
and read, with exact block ids, slots and hashes."""

from tokenmill.core.block_pool import hash_block
from tokenmill.core.cache_tiers import DiskIndex, HostHit, HostTier
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_prefix_cache import BS, req, run
from tests.core.test_scheduler import FakeModel


def evict_all(kv: KVCacheManager, name: str, first: int) -> None:
    """Fill the whole device pool with a request of other tokens, evicting every cached block."""
    n = kv.block_pool.num_blocks
    r = req(name, list(range(first, first + n * BS - 1)))
    run(kv, r)
    kv.free(r)


def test_host_tier_is_lru_and_never_hands_out_a_pinned_slot():
    tier = HostTier(2)
    a, b, c = tier.take_slot(), tier.take_slot(), None
    tier.insert(b"a", a)
    tier.insert(b"b", b)
    assert tier.take_slot() is None  # both pinned by this step
    tier.unpin_all()
    tier.touch(b"a")
    c = tier.take_slot()
    assert c == b and tier.lookup(b"b") is None and tier.lookup(b"a") == a  # b was least recent
    assert tier.num_evictions == 1


def test_disk_index_keeps_the_most_recent_and_names_the_files_to_delete():
    index = DiskIndex(2, [b"old", b"mid", b"new"])
    assert index.initial_excess == [b"old"] and list(index.lru) == [b"mid", b"new"]
    index.touch(b"mid")
    assert index.add(b"x") == [b"new"]
    assert b"mid" in index and b"x" in index and len(index) == 2


def test_evicted_blocks_are_demoted_and_promoted_back():
    kv = KVCacheManager(4, BS, num_host_cache_blocks=4)
    a = req("a", list(range(1, 11)))  # 2 full blocks + 2 tokens
    assert run(kv, a) == [0, 1, 2]
    kv.free(a)  # free queue: 3, 2, 1, 0 (tail first)
    assert kv.take_tier_ops().demote == []
    evict_all(kv, "x", 100)  # takes 3, 2, 1, 0: evicts hashed blocks 1 then 0
    ops = kv.take_tier_ops()
    assert ops.demote == [(1, 0), (0, 1)]  # device block -> host slot
    assert kv.block_pool.cached.keys().isdisjoint(kv.block_hashes(a))
    b = req("b", list(range(1, 11)))
    hits = kv.get_computed_blocks(b)
    hashes = kv.block_hashes(a)
    assert hits == [HostHit(hashes[0], 1), HostHit(hashes[1], 0)]
    ids = kv.allocate_slots(b, 2, hits)
    assert ids is not None and len(ids) == 3
    ops = kv.take_tier_ops()
    assert ops.promote == [(1, ids[0]), (0, ids[1])]  # host slot -> fresh device block
    assert [kv.block_pool.blocks[i].block_hash for i in ids[:2]] == hashes[:2]  # registered again
    assert (kv.device_hit_blocks, kv.device_miss_blocks, kv.host_hit_blocks, kv.host_miss_blocks) == (0, 7, 2, 5)  # a, x, then b
    assert kv.prefix_hit_tokens == 8 and kv.num_promoted_blocks == 2 and kv.num_demoted_blocks == 4
    kv.free(b)
    # A lookup over device and host: the device's run first, then the host's.
    c = req("c", list(range(1, 11)))
    assert [getattr(h, "block_id", None) for h in kv.get_computed_blocks(c)] == ids[:2]


def test_a_block_already_in_the_host_tier_is_not_copied_again():
    kv = KVCacheManager(3, BS, num_host_cache_blocks=4)
    a = req("a", list(range(1, 6)))  # 1 full block
    run(kv, a)
    kv.free(a)
    evict_all(kv, "x", 100)
    assert len(kv.take_tier_ops().demote) == 1
    (a_hash,) = kv.block_hashes(a)
    a_slot = kv.host_tier.lookup(a_hash)
    b = req("b", list(range(1, 6)))
    run(kv, b)  # promoted
    kv.free(b)
    kv.take_tier_ops()
    evict_all(kv, "y", 200)
    demoted = kv.take_tier_ops().demote
    assert demoted and a_slot not in [slot for _, slot in demoted]  # x's blocks, not a's again
    assert kv.host_tier.lookup(a_hash) == a_slot


def test_a_full_host_tier_evicts_its_least_recent_block():
    kv = KVCacheManager(2, BS, num_host_cache_blocks=1)
    for i, name in enumerate("ab"):
        r = req(name, list(range(10 * i + 1, 10 * i + 6)))
        run(kv, r)
        kv.free(r)
        kv.take_tier_ops()  # (a step's copies pin their slots until the worker has them)
        evict_all(kv, f"x{i}", 100 * (i + 1))
        kv.take_tier_ops()
    assert kv.host_tier.num_cached == 1 and kv.host_tier.num_evictions == 2  # a, then x0's block
    assert kv.get_computed_blocks(req("a2", list(range(1, 6)))) == []  # a went
    assert len(kv.get_computed_blocks(req("b2", list(range(11, 16))))) == 1


def test_demotions_write_through_to_disk_and_a_lookup_reads_them_back():
    kv = KVCacheManager(3, BS, num_host_cache_blocks=2, num_disk_cache_blocks=8)
    a = req("a", list(range(1, 10)))  # 2 full blocks
    run(kv, a)
    kv.free(a)
    evict_all(kv, "x", 100)
    hashes = kv.block_hashes(a)
    ops = kv.take_tier_ops()
    assert [h for h, _ in ops.disk_store] == [hashes[1], hashes[0]] and kv.num_disk_written_blocks == 2
    evict_all(kv, "y", 200)  # pushes a's blocks out of the 2 host slots (x's blocks take them)
    kv.take_tier_ops()
    assert kv.host_tier.lookup(hashes[0]) is None and hashes[0] in kv.disk_index
    b = req("b", list(range(1, 10)))
    assert kv.get_computed_blocks(b) == []
    assert kv.waits_for_disk(b, 0)
    reads = kv.take_tier_ops().disk_read
    assert [h for h, _ in reads] == hashes[:2]
    assert kv.get_computed_blocks(b) == [] and kv.take_tier_ops().disk_read == []  # not asked twice
    kv.finish_disk_reads([(hashes[0], True), (hashes[1], False)])  # the second file was corrupted
    assert kv.disk_hit_blocks == 1 and kv.disk_miss_blocks == 1 and hashes[1] not in kv.disk_index
    hits = kv.get_computed_blocks(b)
    assert hits == [HostHit(hashes[0], reads[0][1])] and not kv.waits_for_disk(b, 1)


def test_after_a_restart_the_scheduler_waits_for_disk_reads_and_runs_others_meanwhile():
    tokens = list(range(1, 10))  # 2 full blocks
    h0 = hash_block(None, tokens[:4])
    h1 = hash_block(h0, tokens[4:8])
    kv = KVCacheManager(8, BS, num_host_cache_blocks=2, num_disk_cache_blocks=8, disk_hashes=[h1, h0])
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    sched = Scheduler(config, kv)
    model = FakeModel(sched)
    sched.add_request(req("other", [50, 51, 52], max_tokens=3))
    model.step()
    sched.add_request(req("b", tokens, max_tokens=1))
    out, _ = model.step()
    assert out.num_scheduled_tokens == {"other": 1}  # b waits for its blocks; "other" decodes
    assert out.tier_ops.disk_read == [(h0, 0), (h1, 1)]
    out, _ = model.step()
    assert out.num_scheduled_tokens == {"other": 1} and out.tier_ops.disk_read == []  # (not asked twice)
    kv.finish_disk_reads([(h0, True), (h1, True)])
    out, _ = model.step()
    assert out.num_scheduled_tokens == {"b": 1}  # only the last token is computed
    assert [slot for slot, _ in out.tier_ops.promote] == [0, 1]
    assert kv.disk_hit_blocks == 2 and kv.prefix_hit_tokens == 8


def test_a_failed_disk_read_is_a_miss_and_the_prefix_is_computed():
    tokens = list(range(1, 10))
    h0 = hash_block(None, tokens[:4])
    kv = KVCacheManager(8, BS, num_host_cache_blocks=2, num_disk_cache_blocks=8, disk_hashes=[h0])
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    sched = Scheduler(config, kv)
    model = FakeModel(sched)
    sched.add_request(req("b", tokens, max_tokens=1))
    out, _ = model.step()
    assert out.num_scheduled_tokens == {} and out.tier_ops.disk_read == [(h0, 0)]
    kv.finish_disk_reads([(h0, False)])
    out, _ = model.step()
    assert out.num_scheduled_tokens == {"b": 9} and h0 not in kv.disk_index
    assert kv.disk_miss_blocks == 1 and kv.host_tier._free == [1, 0]  # the slot went back


def test_disabling_the_disk_tier_stops_writes():
    kv = KVCacheManager(2, BS, num_host_cache_blocks=2, num_disk_cache_blocks=8)
    kv.disable_disk_tier()
    a = req("a", list(range(1, 6)))
    run(kv, a)
    kv.free(a)
    evict_all(kv, "x", 100)
    ops = kv.take_tier_ops()
    assert len(ops.demote) == 1 and ops.disk_store == []


def test_at_shutdown_the_cached_blocks_go_to_disk_through_host_slots_in_batches():
    kv = KVCacheManager(4, BS, num_host_cache_blocks=2, num_disk_cache_blocks=8)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token: device blocks 0, 1, 2 hashed
    run(kv, a)
    kv.free(a)  # free queue 3, 2, 1, 0: the prefix's last block is the least recent
    h = kv.block_hashes(a)
    batches = list(kv.persist_batches())
    assert [b.demote for b in batches] == [[(2, 0), (1, 1)], [(0, 0)]]  # 2 host slots: two batches
    assert [b.disk_store for b in batches] == [[(h[2], 0), (h[1], 1)], [(h[0], 0)]]
    assert list(kv.disk_index.lru) == [h[2], h[1], h[0]] and kv.num_persisted_blocks == 3
    assert [kv.block_pool.blocks[i].block_hash for i in range(3)] == h  # the device pool is left as it was
    assert list(kv.persist_batches()) == []  # everything is on disk now


def test_at_shutdown_host_blocks_are_written_from_their_slots_and_the_disk_keeps_the_most_recent():
    kv = KVCacheManager(3, BS, num_host_cache_blocks=2, num_disk_cache_blocks=1)
    a = req("a", list(range(1, 10)))  # 2 full blocks
    run(kv, a)
    kv.free(a)
    evict_all(kv, "x", 100)  # a's blocks demoted; the disk's one place keeps only the later one
    ops = kv.take_tier_ops()
    h = kv.block_hashes(a)
    assert ops.disk_store == [(h[1], 0), (h[0], 1), (h[1], None)] and list(kv.disk_index.lru) == [h[0]]
    kv.disk_index.max_blocks = 3  # room for two more: the host tier's h[1] and x's 2 device blocks, not h[0]
    x = kv.block_hashes(req("x", list(range(100, 111))))  # device blocks 2 (x[0]) and 1 (x[1]); x[1] less recent
    first, second = kv.persist_batches()
    assert first.demote == [(1, 1)] and first.disk_store == [(h[1], 0), (x[1], 1)]  # h[1] from its own slot
    assert second.demote == [(2, 0)] and second.disk_store == [(x[0], 0), (h[0], None)]  # the oldest file goes
    assert list(kv.disk_index.lru) == [h[1], x[1], x[0]]
