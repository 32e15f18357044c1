"""The block pool: hands out fixed-size KV blocks to sequences and takes them back, counting the sequences that hold
each block (with prefix caching, several sequences may hold the same full block: `eyas.cache.prefix_cache`)."""
from __future__ import annotations

from collections import deque

from eyas.cache.prefix_cache import PrefixCache


class BlockManager:
    """Free-list allocator. Block 0 is reserved as scratch (padded writes), so `num_blocks - 1` are usable.

    With `prefix_caching`, a block that the prefix cache holds is parked when its last holder lets it go, not freed:
    it still counts as free, and is evicted (least recently parked first) only once the free list is empty."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_blocks))
        self.refs = [0] * num_blocks  # how many sequences hold each block
        self.prefix = PrefixCache() if prefix_caching else None

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks a reservation may take: the free ones and the parked cached ones."""
        return len(self.free) + (len(self.prefix.parked) if self.prefix is not None else 0)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def num_parked(self, blocks: list[int]) -> int:
        """How many of `blocks` (cached ones a new sequence would share) are parked: sharing them takes them out of
        `num_free`."""
        return sum(self.refs[b] == 0 for b in blocks)

    def blocks_needed(self, block_table: list[int], num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(block_table))

    def can_reserve(self, block_table: list[int], num_slots: int) -> bool:
        return self.blocks_needed(block_table, num_slots) <= self.num_free

    def _take(self) -> int:
        block = self.free.popleft() if self.free else self.prefix.evict()
        self.refs[block] = 1
        return block

    def reserve(self, block_table: list[int], num_slots: int) -> None:
        """Grow `block_table` in place until it holds `num_slots` slots."""
        n = self.blocks_needed(block_table, num_slots)
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        block_table.extend(self._take() for _ in range(n))

    def share(self, blocks: list[int]) -> None:
        """A sequence takes cached `blocks` (its prefix) as its own first ones."""
        for b in blocks:
            if self.refs[b] == 0:
                self.prefix.unpark(b)
            self.refs[b] += 1

    def forget_cached(self) -> int:
        """Forget every cached block (`PrefixCache.clear`): the parked ones become free ones, the held ones plain
        blocks of their holders. Returns how many were cached."""
        if self.prefix is None:
            return 0
        n = len(self.prefix)
        self.free.extend(self.prefix.clear())
        return n

    def release(self, block_table: list[int]) -> None:
        """The sequence lets its blocks go: each one no other sequence holds is freed, or parked if it is cached (the
        table's last blocks first, so that they are evicted before the earlier blocks a longer prefix needs)."""
        for b in reversed(block_table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.prefix is not None and self.prefix.holds(b):
                    self.prefix.park(b)
                else:
                    self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
        block_table.clear()
