"""Padding policies: how each attention backend wants the padded tail of every metadata field.

A captured graph runs over max-size buffers; the rows past the live batch must hold values that
every kernel in the graph treats as "no work" without breaking its contract. Those values are
data, declared per backend in a :class:`PaddingPolicy` and registered here; the planner pads with
the (composed) policy of the backends a model uses and :func:`check` verifies a padded plan.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    from .plan import StepPlan

REPEAT_LAST = "repeat_last"
TailRule = Union[int, str]  # a constant fill, or REPEAT_LAST (repeat the last real value)

# Attention metadata fields a backend may read (built by the runner when any backend reads them).
METADATA_FIELDS = ("query_start_loc", "seq_start_loc", "seq_lens", "block_table", "slot_mapping")
# Model inputs every step has; their tails are part of each policy too.
MODEL_FIELDS = ("input_ids", "positions")
FIELDS = MODEL_FIELDS + METADATA_FIELDS
STEP_KINDS = frozenset({"mixed", "decode"})

DEFAULT_TAILS: Mapping[str, TailRule] = types.MappingProxyType({
    "input_ids": 0,                   # in range for the embedding table
    "positions": 0,                   # in range for the RoPE table
    "query_start_loc": REPEAT_LAST,   # cu_seqlens must stay non-decreasing (binary search, FA)
    "seq_start_loc": REPEAT_LAST,
    "seq_lens": 0,                    # padded requests do no work
    "block_table": 0,                 # the null block: reads land on harmless memory
    "slot_mapping": -1,               # the KV write skips it: padding never touches the cache
})


@dataclass(frozen=True)
class PaddingPolicy:
    """What one attention backend needs from the padded plan.

    Attributes:
        name: the backend's name (the registry key).
        reads: the metadata fields the backend reads (subset of ``METADATA_FIELDS``).
        tails: overrides of ``DEFAULT_TAILS`` (field -> int fill or ``REPEAT_LAST``).
        graph_steps: step kinds the backend may run inside a captured graph ("mixed", "decode").
    """

    name: str
    reads: frozenset[str]
    tails: Mapping[str, TailRule] = field(default_factory=dict)
    graph_steps: frozenset[str] = STEP_KINDS

    def __post_init__(self) -> None:
        reads = frozenset(self.reads)
        unknown = reads - set(METADATA_FIELDS)
        if unknown:
            raise ValueError(
                f"policy {self.name!r} reads unknown metadata fields {sorted(unknown)}; "
                f"the runner builds {list(METADATA_FIELDS)}")
        bad_tails = set(self.tails) - set(FIELDS)
        if bad_tails:
            raise ValueError(f"policy {self.name!r}: tails for unknown fields {sorted(bad_tails)}")
        for name, rule in self.tails.items():
            if not (isinstance(rule, int) or rule == REPEAT_LAST):
                raise ValueError(
                    f"policy {self.name!r}: tail of {name} must be an int or {REPEAT_LAST!r}, got {rule!r}")
        steps = frozenset(self.graph_steps)
        if not steps <= STEP_KINDS:
            raise ValueError(f"policy {self.name!r}: graph_steps must be a subset of {sorted(STEP_KINDS)}")
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "graph_steps", steps)
        object.__setattr__(self, "tails", types.MappingProxyType({**DEFAULT_TAILS, **self.tails}))

    def tail(self, name: str) -> TailRule:
        return self.tails[name]

    def allows_graph(self, decode_only: bool) -> bool:
        return ("decode" if decode_only else "mixed") in self.graph_steps


_REGISTRY: dict[str, PaddingPolicy] = {}


def register_policy(policy: PaddingPolicy, *, replace: bool = False) -> PaddingPolicy:
    """Register ``policy`` under its name (a second registration must say ``replace=True``)."""
    if policy.name in _REGISTRY and not replace and _REGISTRY[policy.name] != policy:
        raise ValueError(f"a padding policy named {policy.name!r} is already registered")
    _REGISTRY[policy.name] = policy
    return policy


def get_policy(name: str) -> PaddingPolicy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no padding policy named {name!r}; registered: {available()}") from None


def available() -> list[str]:
    return sorted(_REGISTRY)


def compose(*policies: PaddingPolicy) -> PaddingPolicy:
    """One policy satisfying every backend of a model.

    Reads are united and graph support intersected. A field's tail must agree among the policies
    that read it (model fields: among all); a disagreement is a ``ValueError`` naming both.
    """
    if not policies:
        raise ValueError("compose() needs at least one policy")
    if len(policies) == 1:
        return policies[0]
    tails: dict[str, TailRule] = {}
    owner: dict[str, str] = {}
    for policy in policies:
        for name in FIELDS:
            if name in METADATA_FIELDS and name not in policy.reads:
                continue
            rule = policy.tail(name)
            if name in tails and tails[name] != rule:
                raise ValueError(
                    f"padding policies {owner[name]!r} and {policy.name!r} conflict on {name}: "
                    f"{tails[name]!r} vs {rule!r}")
            tails.setdefault(name, rule)
            owner.setdefault(name, policy.name)
    return PaddingPolicy(
        name="+".join(p.name for p in policies),
        reads=frozenset().union(*(p.reads for p in policies)),
        tails=tails,
        graph_steps=frozenset.intersection(*(p.graph_steps for p in policies)),
    )


class PlanInvariantError(ValueError):
    """A padded plan breaks an invariant some kernel relies on."""

    def __init__(self, name: str, index: int | tuple, value, expected: str) -> None:
        super().__init__(f"plan field {name}[{index}] = {value}: expected {expected}")
        self.field, self.index, self.value = name, index, value


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_cu(plan: StepPlan, name: str) -> None:
    cu = getattr(plan, name)
    if len(cu) != plan.num_reqs_padded + 1:
        raise PlanInvariantError(name, "len", len(cu), f"num_reqs_padded + 1 = {plan.num_reqs_padded + 1} entries")
    if cu[0] != 0:
        raise PlanInvariantError(name, 0, int(cu[0]), "0")
    drops = np.diff(cu) < 0
    if drops.any():
        i = _first(drops) + 1
        raise PlanInvariantError(name, i, int(cu[i]), f"non-decreasing (previous entry is {int(cu[i - 1])})")
    last = cu[plan.num_reqs]
    off = cu[plan.num_reqs + 1:] != last
    if off.any():
        i = plan.num_reqs + 1 + _first(off)
        raise PlanInvariantError(name, i, int(cu[i]), f"the last real value {int(last)} (padded tail)")


def _check_tail(plan: StepPlan, name: str, start: int, rule: TailRule) -> None:
    arr = getattr(plan, name)
    fill = arr[start - 1] if rule == REPEAT_LAST and start > 0 else rule
    if rule == REPEAT_LAST and start == 0:
        return
    off = arr[start:] != fill
    if off.any():
        i = start + _first(off)
        raise PlanInvariantError(name, i, int(arr[i]), f"the policy's tail {fill!r}")


def _check_slots(plan: StepPlan) -> None:
    slots = plan.slot_mapping[: plan.num_tokens]
    lo, hi = plan.block_size, plan.num_blocks * plan.block_size
    bad = (slots < lo) | (slots >= hi)
    if bad.any():
        i = _first(bad)
        raise PlanInvariantError("slot_mapping", i, int(slots[i]), f"a slot in [{lo}, {hi}) (outside the null block)")
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][0]
        raise PlanInvariantError("slot_mapping", _first(slots == dup), int(dup), "unique slots (written twice)")


def _check_block_table(plan: StepPlan) -> None:
    table = plan.block_table
    bad = (table < 0) | (table >= plan.num_blocks)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise PlanInvariantError("block_table", (int(r), int(c)), int(table[r, c]), f"a block id in [0, {plan.num_blocks})")
    tail = table[plan.num_reqs:]
    if tail.any():
        r, c = np.argwhere(tail)[0]
        raise PlanInvariantError("block_table", (plan.num_reqs + int(r), int(c)), int(tail[r, c]), "the null block 0 (padded row)")


def check(plan: StepPlan, policy: PaddingPolicy) -> None:
    """Raise :class:`PlanInvariantError` (field, index, value) if ``plan`` breaks an invariant."""
    nr, nt = plan.num_reqs, plan.num_tokens
    _check_cu(plan, "query_start_loc")
    _check_cu(plan, "seq_start_loc")
    if plan.query_start_loc[nr] != nt:
        raise PlanInvariantError("query_start_loc", nr, int(plan.query_start_loc[nr]), f"num_tokens = {nt}")
    seq_fill = policy.tail("seq_lens")
    _check_tail(plan, "seq_lens", nr, seq_fill)
    for name in ("input_ids", "positions"):
        _check_tail(plan, name, nt, policy.tail(name))
    _check_tail(plan, "slot_mapping", nt, -1)  # whatever a policy says: padding never writes
    _check_slots(plan)
    _check_block_table(plan)
    expected = plan.query_start_loc[1: nr + 1] - 1
    off = plan.logits_indices[:nr] != expected
    if off.any():
        i = _first(off)
        raise PlanInvariantError("logits_indices", i, int(plan.logits_indices[i]), f"the chunk's last token {int(expected[i])}")
