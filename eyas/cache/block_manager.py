"""The block pool: hands out fixed-size KV blocks to sequences and takes them back."""
from __future__ import annotations

from collections import deque


class BlockManager:
    """Free-list allocator. Block 0 is reserved as scratch (padded writes), so `num_blocks - 1` are usable."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free)

    def blocks_needed(self, block_table: list[int], num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(block_table))

    def can_reserve(self, block_table: list[int], num_slots: int) -> bool:
        return self.blocks_needed(block_table, num_slots) <= len(self.free)

    def reserve(self, block_table: list[int], num_slots: int) -> None:
        """Grow `block_table` in place until it holds `num_slots` slots."""
        n = self.blocks_needed(block_table, num_slots)
        if n > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self.free)} free")
        block_table.extend(self.free.popleft() for _ in range(n))

    def release(self, block_table: list[int]) -> None:
        self.free.extend(block_table)
        block_table.clear()
