"""Physical KV-cache blocks: who holds them (ref counts), which are free (an LRU queue), and
which hold a cached prefix (hash -> block).

Prefix caching: a full block's hash is chained from its parent block's hash and its own token
ids (plus an extra key for anything else that changes KV contents), so equal hashes mean equal
prefixes. SHA-256 is used: a collision (two different prefixes, one hash) is as likely as
guessing a 256-bit key, so hash equality stands for prefix equality; tokens are not compared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """The hash of a full block: its parent's hash, its token ids and `extra_key`."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(extra_key)
    return h.digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the cache


class BlockPool:
    """Owns `num_blocks` blocks. A block is either held (ref_cnt > 0) or in the free queue.

    The free queue is the LRU order: `get_new_blocks` takes from its front, `free_blocks`
    appends to its back. A free block may still hold a cached prefix (its hash stays in
    `cached`): a later request with that prefix takes it back out of the middle of the queue
    (`touch`), and a fresh allocation that reaches it evicts it (drops the hash) first. A block
    held by any running request is never in the queue, so it can never be evicted.

    `on_evict(block_id, block_hash)` is told of each such eviction while the block still holds
    the prefix's contents (the caller's copies run before the step that overwrites it), so the
    prefix can be kept in a lower tier (`core/cache_tiers.py`).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int, BlockHash], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next handed out) first."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the front of the free queue, each with ref_cnt 1,
        evicting the cached prefix any of them held. The caller checks `num_free_blocks` first."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the free
        queue in the order given (pass a request's blocks tail first, so its prefix outlives it)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference to cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (a no-op if it already is, or if another block
        already holds that prefix: then the first one stays the cached copy)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def reset_cache(self) -> int:
        """Forget every cached prefix held by a free block; returns how many were dropped."""
        dropped = [b for b in self._free.values() if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)
