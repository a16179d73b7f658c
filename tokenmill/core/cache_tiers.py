"""The prefix cache below the device pool, as bookkeeping (the data moves in the worker): a host
tier (slots of host memory, LRU) and a disk tier (which block hashes have a file, LRU).

The KV-cache manager demotes a full, hashed block the device pool evicts into a host slot
(copied device -> host before the step's forward pass) and, with a disk tier, writes it through
to disk; a lookup that misses the device continues the match in the host tier (those blocks are
promoted: copied host -> fresh device blocks) and then on disk (read by the worker's background
thread into reserved host slots; the request is admitted on a later step, once they arrived).
The host tier keeps what it promotes, and the disk keeps what it loads (both inclusive), so a
block that goes down again costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.core.block_pool import BlockHash


@dataclass(slots=True)
class HostHit:
    """A prefix-cache hit in the host tier: the block is promoted into a fresh device block when
    the request is admitted."""

    block_hash: BlockHash
    slot: int


class HostTier:
    """`num_slots` host blocks holding demoted prefix blocks, least recently used first.

    A slot is free, cached (in `lru`, under its hash) or loading (in `loading`, being filled from
    disk; it joins `lru` when the read succeeds). A slot that this step's copies read or write
    is pinned until the step's copies are handed to the worker (`unpin_all`): it is neither
    evicted nor reused before those copies ran.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.lru: OrderedDict[BlockHash, int] = OrderedDict()
        self.loading: dict[BlockHash, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 handed out first
        self._pinned: set[int] = set()
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self.lru)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.lru.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        self.lru.move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def take_slot(self) -> int | None:
        """A slot for new contents, pinned: a free one, else the least recently used unpinned
        cached one, evicted (its hash dropped). None when every slot is pinned or loading."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self.lru.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self.lru.pop(victim)
            self.num_evictions += 1
        self._pinned.add(slot)
        return slot

    def insert(self, block_hash: BlockHash, slot: int) -> None:
        """Cache `slot`'s contents under `block_hash` (the most recently used)."""
        assert block_hash not in self.lru and block_hash not in self.loading
        self.lru[block_hash] = slot

    def release(self, slot: int) -> None:
        """Give back a slot that holds nothing (a disk read that failed)."""
        self._free.append(slot)


class DiskIndex:
    """The block hashes that have a file in the disk tier, least recently used first, at most
    `max_blocks` of them. The files themselves are the worker's (`worker/disk_store.py`)."""

    def __init__(self, max_blocks: int, hashes: Iterable[BlockHash] = ()):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.lru: OrderedDict[BlockHash, None] = OrderedDict((h, None) for h in hashes)
        self.initial_excess = self._trim()  # files found at start beyond the bound: delete them

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def add(self, block_hash: BlockHash) -> list[BlockHash]:
        """Record a new file (the most recently used); returns the hashes whose files must go to
        stay within the bound."""
        self.lru[block_hash] = None
        return self._trim()

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        self.lru.pop(block_hash, None)

    def _trim(self) -> list[BlockHash]:
        dropped = []
        while len(self.lru) > self.max_blocks:
            dropped.append(self.lru.popitem(last=False)[0])
        return dropped
