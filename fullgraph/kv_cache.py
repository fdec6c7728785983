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
    """Hands out KV-cache pages 1 .. num_blocks-1 (block 0, the null block, is never returned)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: the lowest ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh page ids; raises ``ValueError`` (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise ValueError(f"asked for {n} KV-cache blocks, only {len(self._free)} of {self.num_blocks - 1} are free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages; raises ``ValueError`` (freeing nothing) for an id that is not allocated."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot free blocks {bad or ids}: not allocated (or listed twice)")
        self._used.difference_update(ids)
        self._free.extend(sorted(ids, reverse=True))

    def is_allocated(self, block_id: int) -> bool:
        return block_id in self._used
