"""The block-sparse attention pattern of Phi-3-Small (local blocks + per-head vertical stride).

Blocks count from absolute position 0: query block ``qb = i // block_size``, key block
``kb = j // block_size``. For global query head ``h``::

    KEEP(h, i, j) = j <= i  and  (qb - kb < local_blocks  or  (kb + h * step + 1) % vert_stride == 0)
    step = 0 if homo_head else max(1, vert_stride // num_heads_total)

Heads are indexed globally (``head_offset`` is the first head this layer holds, e.g. under tensor
parallelism), so every rank and every path (prefill, decode, reference) uses the same pattern.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSparseConfig:
    """The pattern, and which global heads a layer holds.

    Attributes:
        block_size: sparse block size in tokens (64 for Phi-3-Small; a power of two).
        local_blocks: key blocks kept behind (and including) the query's block.
        vert_stride: every ``vert_stride``-th key block is kept (shifted per head).
        homo_head: all heads share one pattern (step 0).
        num_heads_total: query heads of the whole model layer (all ranks).
        head_offset: global index of this layer's first query head.
    """

    block_size: int = 64
    local_blocks: int = 16
    vert_stride: int = 8
    homo_head: bool = False
    num_heads_total: int = 32
    head_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "local_blocks", "vert_stride", "num_heads_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSparseConfig.{name} must be a positive int, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"BlockSparseConfig.block_size must be a power of two, got {self.block_size}")
        if not 0 <= self.head_offset < self.num_heads_total:
            raise ValueError(f"BlockSparseConfig.head_offset {self.head_offset} outside [0, {self.num_heads_total})")

    @property
    def head_step(self) -> int:
        return 0 if self.homo_head else max(1, self.vert_stride // self.num_heads_total)

    def check_page_size(self, page_size: int) -> None:
        """The KV page size and the sparse block size must nest (one divides the other)."""
        if self.block_size % page_size and page_size % self.block_size:
            raise ValueError(
                f"KV-cache block_size {page_size} and sparse block_size {self.block_size} must nest "
                "(one must divide the other), so no page straddles a kept and a skipped sparse block")

    def keep(self, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The block rule (without causality) for ``num_heads`` heads from ``head_offset``.

        q_pos and k_pos broadcast against each other; the result gains a head axis in front of
        their last two dims: q_pos (..., Qm, 1), k_pos (..., 1, L) -> (..., H, Qm, L).
        """
        heads = torch.arange(self.head_offset, self.head_offset + num_heads, device=q_pos.device)
        qb = (q_pos // self.block_size).unsqueeze(-3)                      # (..., 1, Qm, 1)
        kb = (k_pos // self.block_size).unsqueeze(-3)                      # (..., 1, 1, L)
        local = (qb - kb) < self.local_blocks
        vert = (kb + heads[:, None, None] * self.head_step + 1) % self.vert_stride == 0
        return local | vert
