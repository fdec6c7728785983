"""Block ids from Python lists to int64 arrays: the bulk of planning a large decode batch.

``flatten_ids`` concatenates a step's block lists; ``BlockIdCache`` (owned by a runner) keeps the
previous valid decode step's packed ids so an unchanged list is not converted, nor checked, again.
Both serve ``chunks.read_chunks``, which looks a decode step's lists up and commits them once the
step passed its checks.
"""
from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Sequence

import numpy as np


class IdsError(ValueError):
    """An id that is not an integer: ``seq`` is the index of its sequence, ``value`` the value."""

    def __init__(self, seq: int, value: object) -> None:
        super().__init__(f"expected integers, got {type(value).__name__} {value!r:.40}")
        self.seq, self.value = seq, value


def is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, np.integer) and not isinstance(value, np.bool_))


def all_ints(values) -> bool:
    """Whether every value is an int (a bool, float or str is not), in C-speed passes."""
    types = set(map(type, values))
    return types <= {int} or all(t is int or (issubclass(t, np.integer) and t is not np.bool_) for t in types)


def flatten_ids(seqs: list[Sequence[int]], count: int) -> np.ndarray:
    """The sequences concatenated, as int64: the bulk of planning a large batch (its block ids).

    numpy arrays (a caller keeping its block tables in numpy) must hold integers; they are
    concatenated with no Python int in between (~20x faster). Python sequences go through
    ``struct``, about 1.4x faster than ``np.fromiter`` and strict where numpy coerces: a float or a
    str raises ``IdsError`` naming its sequence (numpy would run 7.9 as 7). A bool is an int to
    ``struct``; callers that must refuse bools check with ``all_ints``."""
    if isinstance(seqs[0], np.ndarray):
        for i, seq in enumerate(seqs):
            if not isinstance(seq, np.ndarray) or seq.dtype.kind not in "iu":
                raise IdsError(i, seq if not isinstance(seq, np.ndarray) else seq.dtype)
        return np.concatenate(seqs).astype(np.int64, copy=False)
    try:
        return np.frombuffer(struct.pack(f"{count}q", *itertools.chain.from_iterable(seqs)), np.int64)
    except (struct.error, TypeError):
        for i, seq in enumerate(seqs):
            if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
                raise IdsError(i, seq) from None
            bad = [v for v in seq if not is_int(v)]
            if bad:
                raise IdsError(i, bad[0]) from None
        raise


_VERSIONS = itertools.count(1)   # BlockIdCache versions, never reused


class BlockIdCache:
    """The block ids of a runner's last valid decode step, kept for the next one.

    A decode request's block list changes once every ``block_size`` steps, yet converting its ints
    costs ~15 ns each (thousands a step at batch 32), checking the step's ids another ~10 us and
    scattering them into the block table ~5 us. A list equal (``==``: a pointer comparison per
    unchanged id) to one of the last valid step's reuses its packed ids and block-table row. When
    every list does, each at most once, the step's ids are a subset of ids already found in range
    and distinct, so those two checks are skipped. When the same lists come in the same order and
    the changed ones only grew (a decode batch in which a few requests took a page: most steps of
    a large one, whose page boundaries are staggered), only the appended ids are checked: in
    range, not repeated, in no list of the last valid step (a mask of its ids, kept while the
    lists only grow) and not shared. Any other step is checked in full, and so raises exactly what
    ``plan_step`` raises.
    """

    def __init__(self) -> None:
        # id(list) -> (a copy of the list, its ids as int64 bytes, its block-table row as int32 bytes
        # or None if too long), for the last valid step, under its (num_blocks, row width)
        self._rows: dict[int, tuple[list, bytes, bytes | None]] = {}
        self._limits: tuple[int, int] | None = None
        self._pending: tuple[dict, tuple[int, int] | None] = ({}, None)
        # the last valid step in order: its lists' ids and entries, and what lookup returned for it
        self._order: tuple[list[int], list[tuple], tuple] | None = None
        self._pending_order: tuple[list[int], list[tuple], tuple] | None = None
        # (num_blocks,) bool: the ids of the last valid step in order, or None until a step needs it;
        # and what the step looked up does to it once committed (ids to add, or None: drop it)
        self._member: np.ndarray | None = None
        self._pending_member: list[int] | None = None
        # the committed step's version (unique in the process, so a ledger shared by two caches cannot
        # mistake one's lists for the other's); what the step being looked up adds to the committed one
        # (the ids its lists appended; () for none) or None (other lists), and that once committed
        self.version = next(_VERSIONS)
        self._pending_basis: tuple[int, tuple] | None = None
        self._basis: tuple[int | None, tuple, int] = (None, (), self.version)

    def lookup(self, blk_lists: list[Sequence[int]], count: int, num_blocks: int, width: int,
               shared: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """``flatten_ids(blk_lists, count)``; the block-table rows ``(len(blk_lists), width)`` int32, or
        None; and whether the ids are known to be in range and distinct. ``shared``: the (num_blocks,)
        bool mask of ids several lists may name (none is taken as grown)."""
        limits = (num_blocks, width)
        self._pending_member, self._pending_basis = None, None
        if set(map(type, blk_lists)) != {list}:  # arrays and tuples: converted every step
            self._pending, self._pending_order = ({}, None), None
            return flatten_ids(blk_lists, count), None, False
        keys = list(map(id, blk_lists))
        order = self._order if limits == self._limits else None
        if order is not None and keys == order[0]:
            # the same lists in the same order (a decode batch between its changes): compared at
            # C speed, a changed one repacked; a step with none changed returns the last arrays
            same = list(map(operator.eq, blk_lists, [entry[0] for entry in order[1]]))
            if all(same):   # every list unchanged since a step that passed: in range, distinct
                self._pending, self._pending_order = (self._rows, limits), order
                self._pending_member, self._pending_basis = [], (self.version, ())
                return order[2][0], order[2][1], len(set(keys)) == len(keys)
            entries, grown = [], []
            for entry, ok, ids in zip(order[1], same, blk_lists):
                if ok:
                    entries.append(entry)
                    continue
                entries.append((ids.copy(), *_packed(ids, width)))   # (checks the element types)
                old = entry[0]
                if grown is not None and len(ids) > len(old) and ids[: len(old)] == old:
                    grown.extend(ids[len(old):])
                else:
                    grown = None
            checked = grown is not None and len(set(keys)) == len(keys) and self._fresh(grown, num_blocks, order,
                                                                                       shared)
            result = self._result(keys, entries, limits, checked)
            self._pending_member = grown if checked else None
            self._pending_basis = (self.version, tuple(grown)) if checked else None
            return result
        rows = self._rows if limits == self._limits else {}
        entries, checked = [], True
        for key, ids in zip(keys, blk_lists):
            entry = rows.get(key)
            if entry is None or entry[0] != ids:
                entry, checked = (ids.copy(), *_packed(ids, width)), False
            entries.append(entry)
        return self._result(keys, entries, limits, checked)

    def _result(self, keys: list[int], entries: list[tuple], limits: tuple[int, int], checked: bool):
        pending = dict(zip(keys, entries))
        checked = checked and len(pending) == len(keys)  # else one list came twice: its ids repeat
        rows = [entry[2] for entry in entries]
        table = None if None in rows else np.frombuffer(b"".join(rows), np.int32).reshape(-1, limits[1])
        result = (np.frombuffer(b"".join([entry[1] for entry in entries]), np.int64), table, checked)
        self._pending, self._pending_order = (pending, limits), (keys, entries, result)
        return result

    def _fresh(self, new: list, num_blocks: int, order: tuple, shared: np.ndarray | None) -> bool:
        """Whether ids appended to lists of the last valid step (``order``) keep the step's ids in
        range and distinct: each in [1, num_blocks), not repeated, not shared and in none of its lists."""
        if not all(0 < v < num_blocks for v in new) or len(set(new)) != len(new):
            return False
        if self._member is None or len(self._member) != num_blocks:
            self._member = np.zeros(num_blocks, np.bool_)
            self._member[order[2][0]] = True
        return not np.count_nonzero(self._member[new]) and (shared is None or not np.count_nonzero(shared[new]))

    def commit(self) -> None:
        """The step just looked up passed every check: its lists are the ones to compare with next."""
        self._rows, self._limits = self._pending
        self._order = self._pending_order
        self.version = next(_VERSIONS)
        self._basis = (*(self._pending_basis or (None, ())), self.version)
        if self._pending_member is None:
            self._member = None           # other lists: rebuilt from them when a step needs it
        elif self._member is not None:
            self._member[self._pending_member] = True

    def basis(self) -> tuple[int | None, tuple, int]:
        """For the decode step just committed: (the version its lists are, some grown, or None when
        they are other lists; the ids they appended to that version's; the step's own version). The
        page ledger (``BlockAllocator.check``) then checks the appended ids' owners only, if it found
        every id of that version's lists owned and no page has lost an owner since."""
        return self._basis


def _packed(ids: list, width: int) -> tuple[bytes, bytes | None]:
    """A list's ids as int64 bytes, and as a block-table row of ``width`` (None if longer); its
    element types are checked once, here, when the list is first seen (a bool is refused)."""
    if not all_ints(ids):
        raise IdsError(0, next(v for v in ids if not is_int(v)))
    values = flatten_ids([ids], len(ids))
    if len(values) > width:
        return values.tobytes(), None
    row = np.zeros(width, np.int32)
    row[: len(values)] = values
    return values.tobytes(), row.tobytes()
