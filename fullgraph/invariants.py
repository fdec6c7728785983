"""Invariants of a padded step plan that a kernel relies on, beyond each field's tail.

Each function checks one field of a plan (duck-typed: any object with the plan's attributes) and
raises :class:`PlanInvariantError` naming the field, index and value. The field table
(``fullgraph.fields``) attaches them to their fields; ``padding.check`` runs them, with the tail
check every field gets. Pure numpy; no project imports.
"""
from __future__ import annotations

import numpy as np


class PlanInvariantError(ValueError):
    """A padded plan breaks an invariant some kernel relies on."""

    def __init__(self, name: str, index: int | tuple | str, value, expected: str) -> None:
        super().__init__(f"plan field {name}[{index}] = {value}: expected {expected}")
        self.field, self.index, self.value = name, index, value


def first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _cumulative(plan, name: str) -> None:
    """Starts at 0, has R + 1 entries, never decreases (binary searches and FlashAttention need it)."""
    cu = getattr(plan, name)
    if len(cu) != plan.num_reqs_padded + 1:
        raise PlanInvariantError(name, "len", len(cu), f"num_reqs_padded + 1 = {plan.num_reqs_padded + 1} entries")
    if cu[0] != 0:
        raise PlanInvariantError(name, 0, int(cu[0]), "0")
    drops = np.diff(cu) < 0
    if drops.any():
        i = first(drops) + 1
        raise PlanInvariantError(name, i, int(cu[i]), f"non-decreasing (previous entry is {int(cu[i - 1])})")


def query_start_loc(plan) -> None:
    _cumulative(plan, "query_start_loc")
    nr, nt = plan.num_reqs, plan.num_tokens
    if plan.query_start_loc[nr] != nt:
        raise PlanInvariantError("query_start_loc", nr, int(plan.query_start_loc[nr]), f"num_tokens = {nt}")


def seq_start_loc(plan) -> None:
    _cumulative(plan, "seq_start_loc")


def slots(plan) -> None:
    """Real tokens write real, distinct slots outside the null block (the tail check keeps -1)."""
    real = plan.slot_mapping[: plan.num_tokens]
    lo, hi = plan.block_size, plan.num_blocks * plan.block_size
    bad = (real < lo) | (real >= hi)
    if bad.any():
        i = first(bad)
        raise PlanInvariantError("slot_mapping", i, int(real[i]), f"a slot in [{lo}, {hi}) (outside the null block)")
    uniq, counts = np.unique(real, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][0]
        raise PlanInvariantError("slot_mapping", first(real == dup), int(dup), "unique slots (written twice)")


def block_table(plan) -> None:
    table = plan.block_table
    bad = (table < 0) | (table >= plan.num_blocks)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise PlanInvariantError("block_table", (int(r), int(c)), int(table[r, c]),
                                 f"a block id in [0, {plan.num_blocks})")
    tail = table[plan.num_reqs:]
    if tail.any():  # whatever a policy says: a padded row reads only the null block
        r, c = np.argwhere(tail)[0]
        raise PlanInvariantError("block_table", (plan.num_reqs + int(r), int(c)), int(tail[r, c]),
                                 "the null block 0 (padded row)")


def logits_indices(plan) -> None:
    nr = plan.num_reqs
    expected = plan.query_start_loc[1: nr + 1] - 1
    off = plan.logits_indices[:nr] != expected
    if off.any():
        i = first(off)
        raise PlanInvariantError("logits_indices", i, int(plan.logits_indices[i]),
                                 f"the chunk's last token {int(expected[i])}")
