"""BlockManager: paged KV blocks with reference counts and prefix caching. Pure Python.

A block is *used* while its ref count is > 0. A free block may still hold the KV of a
full, hashed block: it stays findable by its hash (prefix cache) until it is handed out
again (free_blocks.py: plain blocks first, most recently freed first; then cached ones,
least recently freed first). The hash chain of a sequence is seeded with its adapter
id, so two adapters (or two loads of one adapter) never share KV, and with its
``lora_scale`` when not 1, so two scales of one adapter never share KV either (a scale of 0
runs the base model exactly, so it is keyed as the base model's and shares its KV). An
activated LoRA (``Sequence.adapter_start`` > 0) runs the base model before its invocation:
its blocks wholly before ``adapter_start`` are keyed as the base model's (a base
conversation's cached blocks serve it, and its own serve the base), the rest by adapter
and ``adapter_start`` (the same tokens activated elsewhere in the block hold other KV),
chained from that base-keyed prefix; one never invoked (``Sequence.lora_id`` 0) is keyed
as the base model throughout. An adapter with its own token rows changes every position
(``Sequence.base_prefix`` 0): all its blocks are its own.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

from .free_blocks import FreeBlocks
from .sequence import Sequence


def block_hash(parent: bytes, adapter_id: int, tokens: list[int],
               lora_scale: float = 1.0, adapter_start: int = 0) -> bytes:
    """Collision-resistant hash of a full block given its parent's hash (a scale of 1 and
    an adapter applying from position 0 hash as before either existed)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(adapter_id.to_bytes(8, "little", signed=True))
    if lora_scale != 1.0:
        h.update(struct.pack("<d", lora_scale))
    if adapter_start:
        h.update(b"start" + adapter_start.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id holding that block's KV
        self.free = FreeBlocks(num_blocks)
        self.seq_hashes: dict[str, list[bytes]] = {}  # request_id -> hashes of its full blocks
        self.prefix_hits = 0  # blocks served from the prefix cache, ever
        self.prefix_queries = 0  # full prompt blocks looked up, ever

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    # ---- prefix cache -------------------------------------------------------------------
    def _chain(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        # lora_id 0 (scale 0, an aLoRA never invoked): the base model's KV throughout
        adapter_id = seq.lora_id
        scale = seq.params.lora_scale if adapter_id else 1.0
        start, base = seq.adapter_start, seq.base_prefix
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            # a block wholly before the base prefix's end holds the base model's KV
            keyed = adapter_id if (i + 1) * bs > base else 0
            hashes.append(block_hash(parent, keyed, seq.token_slice(i * bs, (i + 1) * bs),
                                     scale if keyed else 1.0, start if keyed else 0))
        return hashes[:num_full_blocks]

    def match_prefix(self, seq: Sequence) -> None:
        """On a sequence's first schedule: take the cached blocks of its longest cached
        prefix. At least one token is always left to compute (its logits are needed), and a
        sequence that asks for prompt logprobs takes no block past the first prompt token
        whose logprob it still lacks (the logits of the positions before it are needed)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        have = seq.prompt_logprobs
        if have is not None and len(have) < len(seq.prompt_token_ids):
            max_blocks = min(max_blocks, (len(have) - 1) // self.block_size)
        for h in self._chain(seq, max_blocks):
            self.prefix_queries += 1
            block = self.cached.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            self.prefix_hits += 1
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every block's hash: no later lookup finds KV computed before (blocks in
        use keep their KV, and their owners may register them again)."""
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self.free.forget_cached()

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: make the sequence's newly full, computed blocks findable."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self._chain(seq, full)):
            block = seq.block_table[i]
            if self.block_hashes[block] is None and h not in self.cached:
                self.block_hashes[block] = h
                self.cached[h] = block

    # ---- allocation ---------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.free.remove(block)
        self.ref_counts[block] += 1

    def _fresh_block(self) -> int:
        block, _ = self.free.pop()
        old = self.block_hashes[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free)} free")
        for _ in range(need):
            seq.block_table.append(self._fresh_block())

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give ``child`` the blocks of ``parent``'s computed prompt: the full blocks shared
        (ref counts), the last partial one copied on write into a fresh block. Returns the
        (src, dst) block copy the KV cache must make (or (-1, -1): none); None when no
        block is free for the copy (``child`` then recomputes, as after a preemption)."""
        assert not child.block_table
        computed = parent.num_computed_tokens
        full, partial = divmod(computed, self.block_size)
        if partial and not self.free:
            return None
        for block in parent.block_table[:full]:
            self._take(block)
            child.block_table.append(block)
        copy = (-1, -1)
        if partial:
            copy = (parent.block_table[full], self._fresh_block())
            child.block_table.append(copy[1])
        child.num_computed_tokens = computed
        if self.enable_prefix_caching:
            self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, []))
        return copy

    def free_seq(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its first blocks become the first to be reused
        (freed last: a new sequence's prompt lands where this one's did)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free.add(block, self.block_hashes[block] is not None)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        self.seq_hashes.pop(seq.seq_id, None)

    def check(self, holders: list[Sequence]) -> None:
        """Assert the books: each block's ref count is the number of ``holders`` (the
        running sequences) whose table holds it, and a block is free iff its count is 0."""
        counts = [0] * self.num_blocks
        for seq in holders:
            for block in seq.block_table:
                counts[block] += 1
        assert counts == self.ref_counts, "KV block ref counts disagree with the block tables"
        free = {b for b, c in enumerate(counts) if c == 0}
        assert free == set(self.free), "free KV blocks disagree with the ref counts"
