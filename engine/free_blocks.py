"""FreeBlocks: the KV blocks no sequence holds, in the order they are handed out again.

First the blocks that hold no cached KV, most recently freed first: their pages are
committed and likely still in the CPU's caches, so a steady load keeps reusing the same few
blocks, and the pool's untouched blocks (reserved address space, host_pages.py) are only
reached when the blocks in circulation run out. Handing out the least recently freed block
instead walks the whole pool: every page of the KV budget ends up committed, and each step
writes KV into memory that left the caches long ago (about 5 % of decode throughput on a
2-core Xeon: benchmarks/results/2026-12-02-kv-block-reuse.md).

Then the blocks that still hold a full, hashed block's KV (the prefix cache), least recently
freed first, so a cached prefix stays findable as long as any plain block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class FreeBlocks:
    def __init__(self, num_blocks: int):
        # insertion order: dict.popitem() takes the last in, so block 0 goes out first
        self.plain: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    def __len__(self) -> int:
        return len(self.plain) + len(self.cached)

    def __iter__(self) -> Iterator[int]:
        yield from self.plain
        yield from self.cached

    def add(self, block: int, holds_cached_kv: bool) -> None:
        """``block`` became free (its ref count reached 0)."""
        (self.cached if holds_cached_kv else self.plain)[block] = None

    def remove(self, block: int) -> None:
        """A free block is taken back as it is (a prefix-cache hit)."""
        if block in self.cached:
            del self.cached[block]
        else:
            del self.plain[block]

    def pop(self) -> tuple[int, bool]:
        """The next block to hand out, and whether it held cached KV (to forget)."""
        if self.plain:
            return self.plain.popitem()[0], False
        return self.cached.popitem(last=False)[0], True

    def forget_cached(self) -> None:
        """The prefix cache was reset: no free block holds findable KV any more."""
        self.plain.update(self.cached)
        self.cached.clear()
