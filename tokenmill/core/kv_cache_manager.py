"""Per-request block tables over a BlockPool: allocate slots for scheduled tokens, free on finish."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the blocks holding its KV entries (its block table).

    A request holds exactly `cdiv(num_computed_tokens + num_scheduled_tokens, block_size)`
    blocks after `allocate_slots`: blocks are taken only for tokens scheduled now, never for
    tokens not yet produced.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more KV entries after the request's computed ones.
        Returns the ids of the blocks added to its table (maybe none), or None, changing
        nothing, when too few blocks are free."""
        assert num_new_tokens > 0
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        if num_needed <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(blocks[::-1])
