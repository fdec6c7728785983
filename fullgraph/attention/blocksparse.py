"""The block-sparse attention pattern of Phi-3-Small (local blocks + per-head vertical stride).

Blocks count from absolute position 0: query block ``qb = i // block_size``, key block
``kb = j // block_size``. For global query head ``h``::

    KEEP(h, i, j) = j <= i  and  (qb - kb < local_blocks  or  (kb + h * step + 1) % vert_stride == 0)
    step = 0 if homo_head else max(1, vert_stride // num_heads_total)

Heads are indexed globally (``head_offset`` is the first head this layer holds, e.g. under tensor
parallelism), so every rank and every path (prefill, decode, reference) uses the same pattern.

``build_layout`` turns the rule into a :class:`BlockSparseLayout` (per head and query block: the
kept key blocks), built once on the device and read by the Triton prefill kernel;
``build_group_layout`` into a :class:`BlockSparseGroupLayout` (per KV head: the union of its query
heads' blocks, each with the heads that keep it), read by the GQA-packed decode kernel.
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
        return keep_mask(q_pos, k_pos, self.as_ints(), num_heads)

    def as_ints(self) -> list[int]:
        """[block_size, local_blocks, vert_stride, head_step, head_offset] (for custom ops)."""
        return [self.block_size, self.local_blocks, self.vert_stride, self.head_step, self.head_offset]


def keep_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, pattern: list[int], num_heads: int) -> torch.Tensor:
    """The KEEP rule of the module docstring (without causality) from ``BlockSparseConfig.as_ints``."""
    block, local_blocks, stride, step, offset = pattern
    heads = torch.arange(offset, offset + num_heads, device=q_pos.device)
    qb = (q_pos // block).unsqueeze(-3)                                # (..., 1, Qm, 1)
    kb = (k_pos // block).unsqueeze(-3)                                # (..., 1, 1, L)
    local = (qb - kb) < local_blocks
    vert = (kb + heads[:, None, None] * step + 1) % stride == 0
    return local | vert


@dataclass(frozen=True, eq=False)
class BlockSparseLayout:
    """The kept key blocks of every (local head, query block), built once on the device.

    Format (count + index table, rows sorted ascending and padded with -1)::

        counts:  (H, NQB) int32       kept key blocks of query block qb for local head h
        indices: (H, NQB, W) int32    indices[h, qb, :counts[h, qb]] = the kept key blocks,
                                      ascending: the vertical blocks before the local window,
                                      then the local window, whose last entry is qb itself
                                      (the diagonal block); -1 past the count

    ``H`` is the layer's (local) head count, head ``h`` using the pattern of global head
    ``head_offset + h``; ``NQB = cdiv(max_model_len, block_size)``; ``W`` the widest row.
    Causality inside the diagonal block is left to the kernels.
    """

    config: BlockSparseConfig
    num_heads: int
    max_model_len: int
    counts: torch.Tensor
    indices: torch.Tensor

    @property
    def num_q_blocks(self) -> int:
        return self.counts.shape[1]

    @property
    def width(self) -> int:
        return self.indices.shape[2]


def _vertical_phase(config: BlockSparseConfig, head: int) -> int:
    """First vertical key block of a global head: the smallest kb with (kb + h*step + 1) % vs == 0."""
    return (-1 - head * config.head_step) % config.vert_stride


def build_layout(config: BlockSparseConfig, num_heads: int, max_model_len: int,
                 device: torch.device | str = "cpu") -> BlockSparseLayout:
    """Build the :class:`BlockSparseLayout` of ``num_heads`` heads from ``config.head_offset``.

    Vectorised over heads, query blocks and slots (no Python loop over blocks): the kept blocks of
    row (h, qb) are the vertical blocks ``c_h, c_h + vs, ...`` below the local window
    ``[lo, qb]``, ``lo = max(0, qb - local_blocks + 1)``, then that window. The 128K Phi-3-Small
    layout (32 heads, 2048 query blocks, width 270) is 17.7M int32 entries.
    """
    if num_heads < 1 or max_model_len < 1:
        raise ValueError(f"build_layout needs num_heads >= 1 and max_model_len >= 1, got {num_heads}, {max_model_len}")
    if config.head_offset + num_heads > config.num_heads_total:
        raise ValueError(f"heads [{config.head_offset}, {config.head_offset + num_heads}) exceed "
                         f"num_heads_total {config.num_heads_total} (head_offset {config.head_offset})")
    device = torch.device(device)
    nqb = -(-max_model_len // config.block_size)
    vs, local = config.vert_stride, config.local_blocks
    phases = [_vertical_phase(config, h) for h in range(config.head_offset, config.head_offset + num_heads)]
    # Rows only grow with qb, so the last row is the widest: a host int, no device sync.
    last_lo = max(0, nqb - local)
    width = min(nqb, local) + max(max(0, -(-(last_lo - p) // vs)) for p in phases)

    i32 = dict(device=device, dtype=torch.int32)
    phase = torch.tensor(phases, **i32)[:, None, None]                     # (H, 1, 1)
    qb = torch.arange(nqb, **i32)[None, :, None]                           # (1, NQB, 1)
    lo = (qb - local + 1).clamp_(min=0)                                    # first local block
    n_vert = torch.div(lo - phase + (vs - 1), vs, rounding_mode="floor").clamp_(min=0)  # (H, NQB, 1)
    counts = n_vert + (qb - lo + 1)                                        # (H, NQB, 1)
    slot = torch.arange(width, **i32)                                      # (W,)
    indices = torch.where(slot < n_vert, phase + slot * vs, lo + slot - n_vert)  # (H, NQB, W)
    indices.masked_fill_(slot >= counts, -1)
    return BlockSparseLayout(config, num_heads, max_model_len, counts[..., 0].contiguous(), indices)


GROUP_BITS = 16  # entry = kb << GROUP_BITS | head bits: up to 16 query heads per KV head


@dataclass(frozen=True, eq=False)
class BlockSparseGroupLayout:
    """Per KV head and query block, the union of the key blocks its query heads keep, built once
    on the device (decode reads each such block once for the whole group).

    Format (count + entry table, rows ascending by key block, padded with -1)::

        counts:  (KVH, NQB) int32       key blocks kept by at least one head of the group
        entries: (KVH, NQB, W) int32    ``kb << GROUP_BITS | bits``: bit g set when the group's
                                        g-th query head (head ``kvh * G + g``) keeps block kb

    The local window is kept by every head (all G bits); a block below it only by the heads whose
    vertical phase it matches.
    """

    layout: BlockSparseLayout
    num_kv_heads: int
    counts: torch.Tensor
    entries: torch.Tensor

    @property
    def group(self) -> int:
        return self.layout.num_heads // self.num_kv_heads

    @property
    def width(self) -> int:
        return self.entries.shape[2]


def build_group_layout(layout: BlockSparseLayout, num_kv_heads: int) -> BlockSparseGroupLayout:
    """The :class:`BlockSparseGroupLayout` of ``layout``'s heads grouped by ``num_kv_heads``.

    Below the local window ``[lo, qb]`` group k keeps the blocks ``kb`` with ``kb % vs`` in the set
    ``S_k`` of its heads' vertical phases (u of them, ascending); in ascending order the j-th is
    ``vs * (j // u) + S_k[j % u]``, so every row is a closed form (no sort), vectorised over query
    blocks and slots, one small loop over KV heads.
    """
    config, num_heads = layout.config, layout.num_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads or num_heads // num_kv_heads > GROUP_BITS:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads: need H a multiple of KVH "
                         f"and at most {GROUP_BITS} query heads per KV head")
    nqb, vs, local = layout.num_q_blocks, config.vert_stride, config.local_blocks
    if nqb >= 1 << (31 - GROUP_BITS):
        raise ValueError(f"{nqb} sparse blocks do not fit the {31 - GROUP_BITS}-bit block field of a group entry")
    group, device = num_heads // num_kv_heads, layout.counts.device
    i32 = dict(device=device, dtype=torch.int32)
    qb = torch.arange(nqb, **i32)[:, None]                                 # (NQB, 1)
    lo = (qb - local + 1).clamp_(min=0)
    last_lo = max(0, nqb - local)
    groups = []
    for k in range(num_kv_heads):
        phases = [_vertical_phase(config, config.head_offset + k * group + g) for g in range(group)]
        distinct = sorted(set(phases))
        bits = [sum(1 << g for g, p in enumerate(phases) if p == d) for d in distinct]
        width = min(nqb, local) + sum(max(0, -(-(last_lo - p) // vs)) for p in distinct)
        groups.append((distinct, bits, width))
    width = max(w for _, _, w in groups)
    slot = torch.arange(width, **i32)[None, :]                             # (1, W)
    counts, entries = [], []
    for distinct, bits, _ in groups:
        u = len(distinct)
        phase_of, bits_of = torch.tensor(distinct, **i32), torch.tensor(bits, **i32)
        n_vert = sum(torch.div(lo - p + (vs - 1), vs, rounding_mode="floor").clamp(min=0) for p in distinct)
        count = n_vert + (qb - lo + 1)                                      # (NQB, 1)
        vertical = slot < n_vert
        kb = torch.where(vertical, vs * (slot // u) + phase_of[slot % u], lo + slot - n_vert)
        head_bits = torch.where(vertical, bits_of[slot % u], (1 << group) - 1)
        entry = (kb << GROUP_BITS) | head_bits
        counts.append(count[:, 0])
        entries.append(entry.masked_fill_(slot >= count, -1))
    return BlockSparseGroupLayout(layout, num_kv_heads, torch.stack(counts).contiguous(),
                                  torch.stack(entries).contiguous())
