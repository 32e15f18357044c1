"""Prefix caching: full KV blocks outlive the sequence that filled them, and a later prompt that starts with the same
tokens takes them instead of computing them again (vLLM's automatic prefix caching, SGLang's radix cache).

What a block may be shared for. Block b of a sequence holds positions bB..bB+B-1 (B = block size) of two caches:
* the target's K/V at position p, a function of the tokens x_0..x_p;
* the draft's K/V at position p, computed from the pair (x_{p+1}, h_p) (`eyas.engine.sequence`): a function of the
  tokens x_0..x_{p+1}, one more than the target's.
So a block is cached only once both caches hold all its positions and the token after it is known, and its key is
its tokens *and the next one*: two prompts that agree on a block's tokens but not on the token after it do not share
it, because the draft's entry at the block's last position differs.

Keys are exact, not hashes: (the entry id of the block before it in the sequence, 0 for the first; its B + 1
tokens). Entry ids are never reused, so when a block is evicted, the entries of the blocks that followed it (keyed by
its id) can no longer be reached from a prompt's first block, whatever its block number is given to next.

A cached block that no sequence holds is *parked*: it counts as free (`BlockManager.num_free`) and is handed out
again, least recently parked first, only when the free list is empty (`evict`)."""
from __future__ import annotations

import itertools
from collections import OrderedDict

ROOT = 0  # the "entry before" a sequence's first block


class PrefixCache:
    def __init__(self):
        self.entries: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # key -> (entry id, block)
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its key
        self.parked: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, oldest first
        self._ids = itertools.count(ROOT + 1)
        self.version = 0  # moves whenever an entry is made or forgotten: what a lookup finds may have changed

    def __len__(self) -> int:
        return len(self.key_of)

    def holds(self, block: int) -> bool:
        return block in self.key_of

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> tuple[int, int] | None:
        """(entry id, block) of the block keyed (parent, tokens), or None."""
        return self.entries.get((parent, tokens))

    def insert(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Cache `block` under (parent, tokens) and return its entry id. If another block already holds that key,
        `block` is left out (it is freed as usual when its sequence lets it go) and the other's id is returned:
        the sequence's next blocks are keyed after it, as their contents are the same."""
        key = (parent, tokens)
        found = self.entries.get(key)
        if found is not None:
            return found[0]
        if block in self.key_of:
            raise RuntimeError(f"block {block} is cached already")
        entry = next(self._ids)
        self.entries[key] = (entry, block)
        self.key_of[block] = key
        self.version += 1
        return entry

    def park(self, block: int) -> None:
        self.parked[block] = None

    def unpark(self, block: int) -> None:
        del self.parked[block]

    def clear(self) -> list[int]:
        """Forget every entry; return the parked blocks (now plain free ones)."""
        parked = list(self.parked)
        self.entries.clear()
        self.key_of.clear()
        self.parked.clear()
        self.version += 1
        return parked

    def evict(self) -> int:
        """Forget the least recently parked block and return it, for reuse."""
        block, _ = self.parked.popitem(last=False)
        del self.entries[self.key_of.pop(block)]
        self.version += 1
        return block
