"""Paged KV cache: one tensor per attention layer and a block allocator that reserves the null block.

Layout of each layer's cache (the FlashAttention / vLLM layout)::

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)   # [0] = keys, [1] = values

Token at position p of a request lives in page ``block_ids[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset``. Block 0 is the null block:
zero-filled at allocation, never handed out, never written; padded rows of the block table point
at it so any stray read lands on finite memory.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
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
    keeps the ledger a runner checks every step against (vectorised numpy, on the host): how many
    owners each page has, which pages are *cached*, and how many leading positions of each have
    been written.

    ``allocate`` / ``free`` hand out and take back single-owner pages (what a direct runner user
    needs). Sharing is the engine's explicit opt-in (prefix caching): ``seal`` marks a fully written
    page *cached* (from then on immutable: its KV is shared by content), ``share`` adds an owner to
    cached pages, ``release`` drops one. A cached page nobody owns is not freed but kept
    *evictable* (least recently released first), still counted in ``num_free``: ``allocate`` takes
    plain free pages first and evicts only when there are none, telling ``on_evict(page)`` (the
    prefix cache, which forgets the page's hash).

    What the ledger proves each step (``check``): a chunk names only owned pages, reads only
    positions written before, and writes no shared page (cached, or with several owners). Which
    request owns a page it cannot know: a chunk naming another live request's private pages is
    refused by the planner within one step (only cached pages may appear in several chunks), but
    across steps it is the caller's mistake to avoid (the engine owns pages: its requests never do).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: the lowest ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unowned; least recently released first
        self._owners = np.zeros(num_blocks, dtype=np.int32)
        self.cached = np.zeros(num_blocks, dtype=bool)          # sealed: fully written, immutable, shareable
        self.written = np.zeros(num_blocks, dtype=np.int32)     # leading positions of each page written
        self.num_cached = 0                                     # cached pages, owned or evictable
        self.evictions = 0
        # releases so far, and (a BlockIdCache version, the releases then) whose lists' every id was
        # owned: while no page loses an owner, those lists are still owned (see ``check``)
        self._releases = 0
        self._owned_lists: tuple[int, int] | None = None
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def allocated(self) -> np.ndarray:
        """(num_blocks,) bool: pages with at least one owner."""
        return self._owners > 0

    def owners(self, ids: Iterable[int]) -> np.ndarray:
        """How many owners each page of ``ids`` has (0: free or evictable)."""
        return self._owners[np.asarray(list(ids), dtype=np.int64)]

    def is_allocated(self, block_id: int) -> bool:
        return 0 < block_id < self.num_blocks and bool(self._owners[block_id])

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh single-owner page ids (evicting cached pages only when no plain free page is
        left); raises ``ValueError`` (allocating nothing) if fewer than ``n`` can be handed out."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks (expected an int >= 0)")
        if n > self.num_free:
            raise ValueError(f"asked for {n} KV-cache blocks, only {self.num_free} of {self.num_blocks - 1} are free")
        take = min(n, len(self._free))
        ids = [self._free.pop() for _ in range(take)] + [self._evict() for _ in range(n - take)]
        self._owners[ids] = 1
        self.written[ids] = 0
        return ids

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        self.cached[page] = False
        self.num_cached -= 1
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def free(self, ids: Iterable[int]) -> None:
        """Return single-owner pages; raises ``ValueError`` (freeing nothing) for an id that is not
        allocated, is listed twice, or has other owners (``release`` drops one owner of a shared page)."""
        ids = self._owned(ids, "free")
        shared = [i for i in ids if self._owners[i] > 1]
        if shared:
            raise ValueError(f"cannot free block {shared[0]}: it has {int(self._owners[shared[0]])} owners "
                             "(release() drops one owner of a shared page)")
        self.release(ids)

    def release(self, ids: Iterable[int]) -> None:
        """Drop one owner of each page. A page left without owners is freed, or, if cached, becomes
        evictable: pages are released in the order given, and the first released is evicted first
        (pass a request's pages last page first, so its tail goes before the prefix others share)."""
        ids = self._owned(ids, "release")
        self._releases += 1
        self._owners[ids] -= 1
        freed = []
        for i in ids:
            if self._owners[i] == 0:
                if self.cached[i]:
                    self._evictable[i] = None
                else:
                    freed.append(i)
        self.written[freed] = 0
        self._free.extend(sorted(freed, reverse=True))

    def share(self, ids: Iterable[int]) -> None:
        """Add an owner to each page of ``ids``, all cached (an evictable one is revived); raises
        ``ValueError`` (sharing nothing) for a page that is not cached or is listed twice."""
        ids = list(ids)
        bad = [i for i in ids if not (_is_id(i, self.num_blocks) and self.cached[i])]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot share blocks {bad or ids}: only cached pages (seal()), each once, are shared")
        for i in ids:
            self._evictable.pop(i, None)
        self._owners[ids] += 1

    def seal(self, ids: Sequence[int], block_size: int) -> None:
        """Mark owned, fully written pages cached: from now on immutable (``check`` refuses a step
        writing them) and shareable. Raises ``ValueError`` (sealing nothing) for a page that is not
        owned, already cached, or has a position not yet written (a partial page is never shared)."""
        ids = self._owned(ids, "seal")
        for i in ids:
            if self.cached[i] or self.written[i] < block_size:
                why = ("is already cached" if self.cached[i] else
                       f"has {int(self.written[i])} of {block_size} positions written")
                raise ValueError(f"cannot seal block {i}: it {why} (only a full, written page is cached)")
        self.cached[ids] = True
        self.num_cached += len(ids)

    def _owned(self, ids: Iterable[int], what: str) -> list[int]:
        ids = list(ids)
        bad = [i for i in ids if not (_is_id(i, self.num_blocks) and self._owners[i] > 0)]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot {what} blocks {bad or ids}: not allocated (or listed twice)")
        return ids

    def copy_from(self, other: BlockAllocator) -> None:
        """Take ``other``'s pages and ledger (a runner holding a copy of another's KV cache)."""
        if other.num_blocks != self.num_blocks:
            raise ValueError(f"copy_from: {other.num_blocks} blocks into an allocator of {self.num_blocks}")
        self._free, self._evictable = list(other._free), OrderedDict(other._evictable)
        self._owners[:], self.cached[:], self.written[:] = other._owners, other.cached, other.written
        self.num_cached = other.num_cached
        self._releases += 1

    def mark_written(self, ids: Sequence[int], num_positions: int, block_size: int) -> None:
        """Declare the first ``num_positions`` positions of a request's pages ``ids`` written, for
        callers that fill the KV cache themselves (benchmarks writing random context, loaders)."""
        ids = np.asarray(ids, dtype=np.int64)
        full, rest = divmod(num_positions, block_size)
        if len(ids) < full + (rest > 0) or not (self._owners[ids] > 0).all():
            raise ValueError(f"mark_written: {len(ids)} pages (all allocated?) cannot hold {num_positions} positions")
        self.written[ids[:full]] = block_size
        if rest:
            self.written[ids[full]] = max(int(self.written[ids[full]]), rest)

    def record_writes(self, slots: np.ndarray, block_size: int) -> None:
        """A step wrote these slots (``block * block_size + offset``, -1 skipped)."""
        if len(slots) <= _FEW:   # a few decode tokens: Python ints (each numpy call costs a microsecond)
            written = self.written
            for slot in slots.tolist():
                if slot >= 0 and written[slot // block_size] <= slot % block_size:
                    written[slot // block_size] = slot % block_size + 1
            return
        slots = slots[slots >= 0]
        np.maximum.at(self.written, slots // block_size, (slots % block_size + 1).astype(np.int32))

    def shared_pages(self) -> np.ndarray | None:
        """The pages several chunks of one step may name (cached ones: nobody writes them), as a
        (num_blocks,) bool mask for the planner; None while there are none."""
        return self.cached if self.num_cached else None

    def check(self, plan, who, basis: tuple[int | None, tuple, int] | None = None) -> None:
        """Raise ``ValueError`` naming the chunk if a real request of ``plan`` names a page that is
        not allocated, reads (attends to) a position no earlier step wrote, or writes a shared page
        (cached, or of several owners: only while any page is cached, since only cached pages can be
        shared, so a runner without prefix caching pays nothing for it). ``who(i)`` names chunk i.
        ``basis``: a decode step's ``BlockIdCache.basis()``; when its lists are those of a version
        whose every id was found owned, no page has lost an owner since, and the ids appended to
        them are owned, the table's owners are not gathered again (most steps of a decode batch).
        The written positions are checked every step."""
        # Tiny arrays at small batches: each numpy call costs about a microsecond, so this uses few
        # (np.count_nonzero, not .any(); a subtraction, not np.diff; cached aranges; Python ints for
        # a few requests).
        if plan.num_reqs > _FEW or not self._few_ok(plan):   # the vectorised check, which also names the culprit
            self._check_all(plan, who, basis)
        if self.num_cached:
            self._check_writes(plan, who)

    def _few_ok(self, plan) -> bool:
        """The checks of ``check`` for a step of a few requests, in Python ints (each numpy call on a
        one-row array costs as much as the row): True when every request passes."""
        bs, qsl, owners, written = plan.block_size, plan.query_start_loc.tolist(), self._owners, self.written
        for r, (seq, row) in enumerate(zip(plan.seq_lens[: plan.num_reqs].tolist(), plan.block_table)):
            pages = -(-seq // bs)
            if np.count_nonzero(owners[row[:pages]]) != pages:
                return False
            context = seq - (qsl[r + 1] - qsl[r])
            if context > 0 and written[row[(context - 1) // bs]] <= (context - 1) % bs:
                return False
        return True

    def _check_all(self, plan, who, basis: tuple[int | None, tuple, int] | None = None) -> None:
        nr, bs = plan.num_reqs, plan.block_size
        seq, qsl = plan.seq_lens[:nr], plan.query_start_loc
        context = seq - (qsl[1: nr + 1] - qsl[:nr])
        table = plan.block_table[:nr]
        # every id in the table allocated (its padding, block 0, is not): then so is every used page,
        # without building the (requests, width) mask of which pages each request uses
        if (basis is not None and basis[0] is not None and self._owned_lists == (basis[0], self._releases)
                and (not basis[1] or np.count_nonzero(self._owners[list(basis[1])]) == len(basis[1]))):
            unallocated = None                                # the owned lists of ``basis[0]``, grown by owned ids
        elif np.count_nonzero(self._owners[table]) == np.count_nonzero(table):
            unallocated = None
        else:
            used = _arange(table.shape[1])[None, :] < ((seq + (bs - 1)) // bs)[:, None]   # pages each request uses
            unallocated = used & (self._owners[table] == 0)
        if unallocated is not None and np.count_nonzero(unallocated):
            r, c = np.argwhere(unallocated)[0]
            raise ValueError(f"{who(int(r))}: block_ids: block {int(table[r, c])} (page {int(c)}) is not allocated "
                             "(never handed out by runner.blocks, or freed)")
        self._owned_lists = (basis[2], self._releases) if basis is not None and unallocated is None else None
        last = np.maximum(context - 1, 0)
        have = self.written[table[_arange(nr), last // bs]]
        short = (context > 0) & (have <= last % bs)
        if np.count_nonzero(short):
            r = int(np.flatnonzero(short)[0])
            held = int(last[r] // bs * bs + have[r])
            raise ValueError(f"{who(r)}: start_pos: {int(context[r])} says that many positions are in the cache, but "
                             f"its pages hold {held} written (page {int(last[r] // bs)} has {int(have[r])} of {bs})")

    def _check_writes(self, plan, who) -> None:
        """No real token's slot lies in a cached page: nor so in a page with several owners, which is
        always cached (``share`` takes only cached pages; a page is uncached only when evicted, unowned)."""
        slots = plan.slot_mapping[: plan.num_tokens]
        page = slots // plan.block_size                                  # real tokens' slots are never -1
        bad = self.cached[page]
        if np.count_nonzero(bad):
            t = int(np.argmax(bad))                                      # the first offending token
            r = int(np.searchsorted(plan.query_start_loc[1: plan.num_reqs + 1], t, side="right"))
            p, n = int(page[t]), int(self._owners[page[t]])
            raise ValueError(f"{who(r)}: slot_mapping: token {t} writes position {int(plan.positions[t])} into block "
                             f"{p}, which has {n} owner{'s' * (n != 1)}{' and is cached' * bool(self.cached[p])}: "
                             "a shared page is never written (a request writes only its private pages)")


_FEW = 4  # up to this many requests, ``check`` walks them in Python


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    """``np.arange(n)``, read-only and cached (the ledger check's row and column indices)."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


def _is_id(i: object, num_blocks: int) -> bool:
    return isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 < i < num_blocks
