"""Paged KV cache: one tensor per attention layer and a block allocator that reserves the null block.

Layout of each layer's cache (the FlashAttention / vLLM layout)::

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)   # [0] = keys, [1] = values

Token at position p of a request lives in page ``block_ids[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset``. Block 0 is the null block:
zero-filled at allocation, never handed out, never written; padded rows of the block table point
at it so any stray read lands on finite memory.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_caches(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zero-filled caches, one per attention layer, in the layout of the module docstring."""
    return [torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
            for s in specs]


class BlockAllocator:
    """Hands out KV-cache pages 1 .. num_blocks-1 (block 0, the null block, is never returned), and
    keeps the ledger a runner checks every step against: which pages are allocated, and how many
    leading positions of each have been written (vectorised numpy, on the host).

    What it can prove is that a chunk reads only positions written before and names only allocated
    pages. Which request owns a page it cannot know: two requests naming the same page in one step
    are refused by the planner, but a chunk naming another live request's pages in a later step is
    the caller's mistake to avoid (the engine owns pages, so its requests never do).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: the lowest ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.allocated = np.zeros(num_blocks, dtype=bool)
        self.written = np.zeros(num_blocks, dtype=np.int32)   # leading positions of each page written

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh page ids; raises ``ValueError`` (allocating nothing) if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks (expected an int >= 0)")
        if n > len(self._free):
            raise ValueError(f"asked for {n} KV-cache blocks, only {len(self._free)} of {self.num_blocks - 1} are free")
        ids = [self._free.pop() for _ in range(n)]
        self.allocated[ids] = True
        self.written[ids] = 0
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages; raises ``ValueError`` (freeing nothing) for an id that is not allocated."""
        ids = list(ids)
        bad = [i for i in ids if not (isinstance(i, (int, np.integer)) and 0 < i < self.num_blocks and self.allocated[i])]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot free blocks {bad or ids}: not allocated (or listed twice)")
        self.allocated[ids] = False
        self.written[ids] = 0
        self._free.extend(sorted(ids, reverse=True))

    def copy_from(self, other: BlockAllocator) -> None:
        """Take ``other``'s pages and ledger (a runner holding a copy of another's KV cache)."""
        if other.num_blocks != self.num_blocks:
            raise ValueError(f"copy_from: {other.num_blocks} blocks into an allocator of {self.num_blocks}")
        self._free = list(other._free)
        self.allocated[:] = other.allocated
        self.written[:] = other.written

    def is_allocated(self, block_id: int) -> bool:
        return 0 < block_id < self.num_blocks and bool(self.allocated[block_id])

    def mark_written(self, ids: Sequence[int], num_positions: int, block_size: int) -> None:
        """Declare the first ``num_positions`` positions of a request's pages ``ids`` written, for
        callers that fill the KV cache themselves (benchmarks writing random context, loaders)."""
        ids = np.asarray(ids, dtype=np.int64)
        full, rest = divmod(num_positions, block_size)
        if len(ids) < full + (rest > 0) or not self.allocated[ids].all():
            raise ValueError(f"mark_written: {len(ids)} pages (all allocated?) cannot hold {num_positions} positions")
        self.written[ids[:full]] = block_size
        if rest:
            self.written[ids[full]] = max(int(self.written[ids[full]]), rest)

    def record_writes(self, slots: np.ndarray, block_size: int) -> None:
        """A step wrote these slots (``block * block_size + offset``, -1 skipped)."""
        slots = slots[slots >= 0]
        np.maximum.at(self.written, slots // block_size, (slots % block_size + 1).astype(np.int32))

    def check(self, plan, who) -> None:
        """Raise ``ValueError`` naming the chunk if a real request of ``plan`` names a page that is
        not allocated, or reads (attends to) a position no earlier step wrote. ``who(i)`` names chunk i."""
        nr, bs = plan.num_reqs, plan.block_size
        seq = plan.seq_lens[:nr].astype(np.int64)
        context = seq - np.diff(plan.query_start_loc[: nr + 1])
        pages = -(-seq // bs)                                          # (R,) pages each request uses
        table = plan.block_table[:nr]
        used = np.arange(table.shape[1])[None, :] < pages[:, None]
        unallocated = used & ~self.allocated[table]
        if unallocated.any():
            r, c = np.argwhere(unallocated)[0]
            raise ValueError(f"{who(int(r))}: block_ids: block {int(table[r, c])} (page {int(c)}) is not allocated "
                             "(never handed out by runner.blocks, or freed)")
        last = np.maximum(context - 1, 0)
        have = self.written[table[np.arange(nr), last // bs]]
        short = (context > 0) & (have < last % bs + 1)
        if short.any():
            r = int(np.flatnonzero(short)[0])
            held = int(last[r] // bs * bs + have[r])
            raise ValueError(f"{who(r)}: start_pos: {int(context[r])} says that many positions are in the cache, but "
                             f"its pages hold {held} written (page {int(last[r] // bs)} has {int(have[r])} of {bs})")
