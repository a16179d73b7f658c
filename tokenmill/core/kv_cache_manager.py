"""Per-request block tables over a BlockPool: prefix-cache lookups (through the host and disk
tiers when there are some), slots for scheduled tokens, swap to a host pool, and freeing on
finish."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenmill.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from tokenmill.core.cache_tiers import DiskIndex, HostHit, HostTier
from tokenmill.core.outputs import TierOps
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# What stands in a block table for a block a sliding window left behind and the pool took back:
# not a pool block (id 0 in a table, never read unmasked).
WINDOW_GAP = KVCacheBlock(block_id=0, ref_cnt=1)


class KVCacheManager:
    """Maps each request to the blocks holding its KV entries (its block table).

    A request holds exactly `cdiv(num_computed_tokens + num_scheduled_tokens, block_size)`
    blocks after `allocate_slots`: blocks are taken only for tokens scheduled now, never for
    tokens not yet produced. With prefix caching, every block that the scheduled tokens fill is
    registered under its hash as soon as it is allocated: the step that computes it runs before
    any later step can read it, and within one step each layer writes all new K/V before any
    attention reads the cache, so even a request admitted in the same step may share it.

    A swapped-out request holds host blocks instead (same count, same order) until it is
    swapped back in.

    With a `sliding_window` (a model whose every layer attends to at most that many latest
    keys), the blocks a request's next queries can no longer see go back to the pool as it
    advances; `WINDOW_GAP` takes their place in its table, so a block's index still says which
    positions it held (attention never reads it: a window mask covers it).

    Cache tiers (`core/cache_tiers.py`), with prefix caching: `num_host_cache_blocks` host slots
    that evicted prefix blocks are demoted to, separate from the swap pool; `num_disk_cache_blocks`
    files below them (`disk_hashes`: the files found at start, oldest first). `take_tier_ops`
    hands each step's copies to the worker.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, extra_key: bytes = b"", sliding_window: int | None = None,
                 num_host_cache_blocks: int = 0, num_disk_cache_blocks: int = 0,
                 disk_hashes: Iterable[BlockHash] = ()):
        self.block_size = block_size
        self.sliding_window = sliding_window
        tiered = enable_caching and num_host_cache_blocks > 0
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict=self._demote if tiered else None)
        self.host_tier = HostTier(num_host_cache_blocks) if tiered else None
        self.disk_index = DiskIndex(num_disk_cache_blocks, disk_hashes) if tiered and num_disk_cache_blocks > 0 else None
        self._tier_ops = TierOps()
        if self.disk_index is not None:
            self._tier_ops.disk_store.extend((h, None) for h in self.disk_index.initial_excess)
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks > 0 else None
        self.extra_key = extra_key  # anything else that changes KV contents (e.g. a quantization id)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered
        # Counters (cumulative).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_copied_blocks = 0  # copy on write
        self.num_forked_blocks = 0  # block references shared by forking (n > 1)
        self.num_window_freed_blocks = 0  # blocks a sliding window left behind, freed early
        # Cache tiers, in blocks: lookups found / not found per tier (the host tier is asked
        # about the device's misses; the disk about blocks read: delivered / failed, a torn or
        # corrupted file among the failures), and blocks moved between them.
        self.device_hit_blocks = self.device_miss_blocks = 0
        self.host_hit_blocks = self.host_miss_blocks = 0
        self.disk_hit_blocks = self.disk_miss_blocks = 0
        self.num_demoted_blocks = 0  # device -> host
        self.num_promoted_blocks = 0  # host -> device
        self.num_disk_written_blocks = 0  # host -> disk (files asked for)
        self.num_disk_read_blocks = 0  # disk -> host (reads asked for)
        self.num_persisted_blocks = 0  # written at shutdown (`persist_batches`), of num_disk_written_blocks
        self._copies: list[tuple[int, int]] = []

    @property
    def enable_caching(self) -> bool:
        return self.block_pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache --------------------------------------------------------------------------

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks (computed once, extended as tokens arrive)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], self.extra_key))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock | HostHit] | None:
        """The longest chain of cached blocks that starts the request's tokens (None: no lookup,
        caching is off or the request wants prompt logprobs, which need every prompt position
        computed): device blocks, then host-tier hits (`HostHit`, promoted on admission). At
        least the last token is left out, so the step that admits it has logits to sample from.
        Pass the result to `allocate_slots`, which counts the lookup once it succeeds (a request
        that has to wait is looked up again next step).

        Where the chain goes on in the disk tier, reads of those blocks into host slots start
        (`TierOps.disk_read`) and `waits_for_disk` says so: the request is best admitted once
        they arrived."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs:
            return None
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)[:limit]
        hits: list[KVCacheBlock | HostHit] = []
        for block_hash in hashes:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        tier = self.host_tier
        if tier is None:
            return hits
        for block_hash in hashes[len(hits):]:
            slot = tier.lookup(block_hash)
            if slot is None:
                break
            tier.pin(slot)  # (nothing this step may take it: reads below, or the request's own blocks)
            hits.append(HostHit(block_hash, slot))
        if self.disk_index is not None:
            self._read_from_disk(hashes[len(hits):])
        return hits

    def _read_from_disk(self, hashes: list[BlockHash]) -> None:
        """Start reading the leading run of `hashes` that is on disk into host slots (blocks
        already on their way count as part of the run)."""
        tier = self.host_tier
        for block_hash in hashes:
            if block_hash in tier.loading:
                continue
            if block_hash not in self.disk_index:
                break
            slot = tier.take_slot()
            if slot is None:
                break
            tier.loading[block_hash] = slot
            self._tier_ops.disk_read.append((block_hash, slot))
            self.num_disk_read_blocks += 1

    def waits_for_disk(self, request: Request, num_hits: int) -> bool:
        """Whether the block after the request's `num_hits` cached ones is being read from disk."""
        tier = self.host_tier
        if tier is None or not tier.loading:
            return False
        hashes = self.block_hashes(request)
        return num_hits < (request.num_tokens - 1) // self.block_size and hashes[num_hits] in tier.loading

    def finish_disk_reads(self, results: Iterable[tuple[BlockHash, bool]]) -> None:
        """The worker's disk reads that ended: (hash, whether its block is now in its host slot).
        A failed one (no file, or a torn or corrupted one) is a miss: its hash leaves the disk."""
        tier = self.host_tier
        for block_hash, ok in results:
            slot = tier.loading.pop(block_hash)
            if ok:
                tier.insert(block_hash, slot)
                self.disk_hit_blocks += 1
                if self.disk_index is not None:
                    self.disk_index.touch(block_hash)
            else:
                tier.release(slot)
                self.disk_miss_blocks += 1
                if self.disk_index is not None:
                    self.disk_index.discard(block_hash)

    def disable_disk_tier(self) -> None:
        """Stop writing to and reading from disk (the worker found it full or unwritable); reads
        already started still end through `finish_disk_reads`."""
        self.disk_index = None

    def _demote(self, block_id: int, block_hash: BlockHash) -> None:
        """The device pool is evicting `block_id`, which holds `block_hash`'s contents: keep them
        in a host slot (and on disk), unless the host tier holds them already or has no slot
        this step's copies leave free."""
        tier = self.host_tier
        if tier.lookup(block_hash) is not None:
            tier.touch(block_hash)
            return
        if block_hash in tier.loading:
            return
        slot = tier.take_slot()
        if slot is None:
            return
        tier.insert(block_hash, slot)
        self._tier_ops.demote.append((block_id, slot))
        self.num_demoted_blocks += 1
        disk = self.disk_index
        if disk is not None and block_hash not in disk:
            self._tier_ops.disk_store.append((block_hash, slot))
            self._tier_ops.disk_store.extend((h, None) for h in disk.add(block_hash))
            self.num_disk_written_blocks += 1

    def persist_batches(self) -> Iterator[TierOps]:
        """At a clean shutdown: write to disk every cached block it does not hold yet, the host
        tier's and then the device pool's, least recently used first, at most as many as the disk
        tier holds (the most recent ones), so the blocks that never left the device (a shared
        system prompt) are there after a restart. Yields the copies in batches of at most the
        host tier's size, each to run (device -> host slot, then the writes from the slots)
        before the next is asked for: device blocks pass through host slots, which a batch pins.
        The device pool itself is left as it is; the host tier's contents are given up. Nothing
        is yielded without a disk tier. The caller must not step the engine afterwards."""
        tier, disk = self.host_tier, self.disk_index
        if disk is None:
            return
        held = [b for b in self.block_pool.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        device = [self.block_pool.blocks[i] for i in self.block_pool.free_block_ids()] + held  # LRU first
        todo: dict[BlockHash, int | None] = {h: None for h in tier.lru if h not in disk}  # hash -> device block id
        for block in device:
            h = block.block_hash
            if h is not None and h not in disk and h not in todo and h not in tier.loading:
                todo[h] = block.block_id
        todo_list = list(todo.items())[-disk.max_blocks:]
        for block_hash, block_id in todo_list:
            if block_id is None:  # already in a host slot
                slot = tier.lookup(block_hash)
                tier.pin(slot)
            else:
                slot = tier.take_slot()
                if slot is None:  # every slot is pinned by this batch: run it first
                    yield self.take_tier_ops()
                    slot = tier.take_slot()
                    if slot is None:  # every slot is being read from disk
                        return
                tier.insert(block_hash, slot)
                self._tier_ops.demote.append((block_id, slot))
            self._tier_ops.disk_store.append((block_hash, slot))
            self._tier_ops.disk_store.extend((h, None) for h in disk.add(block_hash))
            self.num_disk_written_blocks += 1
            self.num_persisted_blocks += 1
        ops = self.take_tier_ops()
        if ops.demote or ops.disk_store:
            yield ops

    def take_tier_ops(self) -> TierOps:
        """The data movement between tiers queued since the last call; the host slots it
        involves may be reused from now on."""
        ops, self._tier_ops = self._tier_ops, TierOps()
        if self.host_tier is not None:
            self.host_tier.unpin_all()
        return ops

    # -- allocation --------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock | HostHit] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more KV entries after the request's computed ones,
        first adopting `computed_blocks` (the `get_computed_blocks` result for a request that
        holds no blocks yet; counted in the prefix-cache stats on success; host-tier hits get
        fresh device blocks, registered under their hashes, and promotion copies). A block the new tokens would write into that someone else also holds, or that is
        registered in the prefix cache, is copied first (copy on write; the copies are queued
        for `take_copies`). Returns the ids of the blocks that joined its table (hits and
        copies included), or None, changing nothing, when too few blocks are free."""
        assert num_new_tokens > 0
        bs = self.block_size
        looked_up = computed_blocks is not None
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        assert not (computed_blocks and blocks), "prefix hits are adopted only by a request without blocks"
        num_computed = request.num_computed_tokens + len(computed_blocks) * bs
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(blocks) - len(computed_blocks)
        written = range(num_computed // bs, min(len(blocks), self.num_blocks_for(num_computed + num_new_tokens)))
        to_copy = [i for i in written if blocks[i].ref_cnt > 1 or blocks[i].block_hash is not None]
        # Hits sitting in the free queue leave it when adopted, and host hits take a fresh block:
        # they count against the free blocks.
        num_free_hits = sum(1 for b in computed_blocks if isinstance(b, HostHit) or b.ref_cnt == 0)
        if max(num_needed, 0) + len(to_copy) + num_free_hits > self.block_pool.num_free_blocks:
            return None
        if looked_up:
            self._count_lookup(request, computed_blocks)
        if any(isinstance(b, HostHit) for b in computed_blocks):
            computed_blocks = self._promote(computed_blocks)
        else:
            self.block_pool.touch(computed_blocks)
        joined = list(computed_blocks)
        for i in to_copy:
            (fresh,) = self.block_pool.get_new_blocks(1)
            self._copies.append((blocks[i].block_id, fresh.block_id))
            self.block_pool.free_blocks([blocks[i]])
            blocks[i] = fresh
            joined.append(fresh)
            self.num_copied_blocks += 1
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks[:0] = computed_blocks
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        if self.sliding_window is not None:
            self._release_out_of_window(blocks, num_computed)
        return [b.block_id for b in (*joined, *new_blocks)]

    def _count_lookup(self, request: Request, hits: list[KVCacheBlock | HostHit]) -> None:
        bs = self.block_size
        self.prefix_query_tokens += request.num_tokens
        self.prefix_hit_tokens += len(hits) * bs
        limit = (request.num_tokens - 1) // bs
        num_host = sum(1 for b in hits if isinstance(b, HostHit))
        self.device_hit_blocks += len(hits) - num_host
        self.device_miss_blocks += limit - len(hits) + num_host
        if self.host_tier is not None:
            self.host_hit_blocks += num_host
            self.host_miss_blocks += limit - len(hits)

    def _promote(self, hits: list[KVCacheBlock | HostHit]) -> list[KVCacheBlock]:
        """The device blocks for a lookup's hits: device hits taken as they are, each host hit
        copied into a fresh block registered under its hash."""
        device_hits = [b for b in hits if not isinstance(b, HostHit)]
        host_hits = hits[len(device_hits):]
        assert all(isinstance(h, HostHit) for h in host_hits), "host hits follow the device hits"
        self.block_pool.touch(device_hits)
        for hit in host_hits:  # (pinned at lookup: the evictions below cannot demote into them)
            self.host_tier.touch(hit.block_hash)
        fresh = self.block_pool.get_new_blocks(len(host_hits))
        for hit, block in zip(host_hits, fresh):
            self.block_pool.cache_block(block, hit.block_hash)
            self._tier_ops.promote.append((hit.slot, block.block_id))
        self.num_promoted_blocks += len(host_hits)
        return device_hits + fresh

    def _release_out_of_window(self, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks wholly before the window of the first query scheduled now (at
        position num_computed, seeing keys from num_computed - window + 1 on): no later query
        of the request sees them."""
        first_needed = max(0, num_computed - self.sliding_window + 1) // self.block_size
        for i in range(first_needed):
            if blocks[i] is not WINDOW_GAP:
                self.block_pool.free_blocks([blocks[i]])
                blocks[i] = WINDOW_GAP
                self.num_window_freed_blocks += 1

    def fork(self, child: Request, parent: Request, num_tokens: int) -> None:
        """Let `child` share the parent's blocks holding its first `num_tokens` tokens (n > 1:
        the samples of one prompt). The first write into a shared block copies it."""
        assert child.request_id not in self.req_to_blocks
        shared = self.req_to_blocks[parent.request_id][: self.num_blocks_for(num_tokens)]
        self.block_pool.touch([b for b in shared if b is not WINDOW_GAP])
        self.req_to_blocks[child.request_id] = list(shared)
        self._num_cached_blocks[child.request_id] = min(self._num_cached_blocks.get(parent.request_id, 0), len(shared))
        self.num_forked_blocks += len(shared)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies queued since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return  # (not needed for correctness: it saves hashing)
        req_id = request.request_id
        start = self._num_cached_blocks.get(req_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self.block_hashes(request)
        blocks = self.req_to_blocks[req_id]
        for i in range(start, min(end, len(hashes))):
            if blocks[i] is not WINDOW_GAP:
                self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req_id] = min(end, len(hashes))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release every block of the request, device and host, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks([b for b in blocks[::-1] if b is not WINDOW_GAP])
        self._num_cached_blocks.pop(request.request_id, None)
        host = self.req_to_host_blocks.pop(request.request_id, None)
        if host:
            self.host_pool.free_blocks(host[::-1])

    # -- swap to host --------------------------------------------------------------------------------

    def is_swapped_out(self, request: Request) -> bool:
        return request.request_id in self.req_to_host_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: returns (device block, host block) copies
        to run before anything else this step, or None if the host pool has too few free
        blocks. The device blocks are freed (cached prefixes among them stay cached)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if self.host_pool is None or not blocks or len(blocks) > self.host_pool.num_free_blocks:
            return None
        if WINDOW_GAP in blocks:  # (gaps have no contents to move: such a request is recomputed)
            return None
        host = self.host_pool.get_new_blocks(len(blocks))
        self.req_to_host_blocks[request.request_id] = host
        self.block_pool.free_blocks(blocks[::-1])
        del self.req_to_blocks[request.request_id]
        self._num_cached_blocks.pop(request.request_id, None)
        self.num_swapped_out_blocks += len(blocks)
        return [(d.block_id, h.block_id) for d, h in zip(blocks, host)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether there are device blocks for its host blocks plus `num_new_tokens` more."""
        total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return total <= self.block_pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped-out request back: returns (host block, device block) copies to run
        before the step's forward pass. The caller checked `can_swap_in`."""
        host = self.req_to_host_blocks.pop(request.request_id)
        blocks = self.block_pool.get_new_blocks(len(host))
        self.req_to_blocks[request.request_id] = blocks
        self.host_pool.free_blocks(host[::-1])
        self.num_swapped_in_blocks += len(host)
        return [(h.block_id, d.block_id) for h, d in zip(host, blocks)]
