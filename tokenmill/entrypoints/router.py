"""Which engine replica serves a request under data parallelism: the one that already holds the
longest cached prefix of its prompt, unless that one is busier than the least loaded replica by
more than `PREFIX_LOAD_SLACK` requests; otherwise the least loaded.

Plain Python (no torch, no HTTP): the front end (`data_parallel.py`) feeds it the prompt's token
ids and tells it when a request ends and how full each replica's KV cache is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.block_pool import BlockHash, hash_block

# A replica holding a prompt's prefix gets it while it has at most this many more requests in
# flight than the least loaded replica: a prefix hit saves a prefill, a few extra requests in a
# replica's batch cost little, many cost every request in it.
PREFIX_LOAD_SLACK = 4
# The most block hashes remembered per replica (about 150 MB of them): a replica whose disk tier
# holds more is remembered for its most recent ones.
MAX_INDEX_BLOCKS = 1 << 20


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's blocks that an engine can take from its prefix cache:
    the full blocks before the last token (the engine always computes the last one)."""
    hashes: list[BlockHash] = []
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class PrefixIndex:
    """The block hashes of the prompts one replica was sent, least recently used first, at most
    `max_blocks` of them (about what the replica's prefix cache can hold: its KV cache and the
    host and disk tiers below it), and never more than MAX_INDEX_BLOCKS."""

    def __init__(self, max_blocks: int):
        assert max_blocks >= 1, max_blocks
        self.max_blocks = min(max_blocks, MAX_INDEX_BLOCKS)
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading `hashes` this replica was sent (a chain: one miss ends it)."""
        num_matched = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            num_matched += 1
        return num_matched

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_blocks:
            self._hashes.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Route:
    replica: int
    reason: str  # "prefix": it holds the longest prefix; "load": the least loaded
    num_matched_blocks: int


class Router:
    """Picks a replica per request and counts the requests in flight on each.

    Contract: every `choose` is followed by exactly one `finish` for the replica it returned,
    when the request's response has ended (or failed)."""

    def __init__(self, num_replicas: int, max_blocks_per_replica: int, load_slack: int = PREFIX_LOAD_SLACK):
        assert num_replicas >= 1, num_replicas
        self.indexes = [PrefixIndex(max_blocks_per_replica) for _ in range(num_replicas)]
        self.load_slack = load_slack
        self.num_in_flight = [0] * num_replicas
        self.num_routed = [0] * num_replicas
        self.kv_cache_usage = [0.0] * num_replicas  # 0-1, as each replica last reported it

    def choose(self, hashes: Sequence[BlockHash]) -> Route:
        """The replica for a prompt with these block hashes (none: by load alone). Ties in
        load go to the replica with the emptier KV cache, then to the one sent fewer requests."""
        replicas = range(len(self.indexes))
        load = lambda i: (self.num_in_flight[i], self.kv_cache_usage[i], self.num_routed[i])  # noqa: E731
        least_loaded = min(replicas, key=load)
        matched = [index.match(hashes) for index in self.indexes]
        longest = max(matched)
        route = Route(least_loaded, "load", matched[least_loaded])
        if longest >= 1:
            holder = min((i for i in replicas if matched[i] == longest), key=load)
            if self.num_in_flight[holder] - self.num_in_flight[least_loaded] <= self.load_slack:
                route = Route(holder, "prefix", longest)
        self.indexes[route.replica].add(hashes)
        self.num_in_flight[route.replica] += 1
        self.num_routed[route.replica] += 1
        return route

    def finish(self, replica: int) -> None:
        assert self.num_in_flight[replica] > 0, f"replica {replica} has no request in flight"
        self.num_in_flight[replica] -= 1
