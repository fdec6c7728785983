"""Padding policies: how each attention backend wants the padded tail of every step field.

A captured graph runs over max-size buffers; the rows past the live batch (the *tail*) must hold
values that every kernel in the graph treats as "no work" without breaking its contract. Each
backend declares them as data, a :class:`PaddingPolicy` (its ``policy`` attribute): the metadata
fields it reads, tail overrides of the field table's defaults (``fullgraph.fields``), extra step
fields of its own, and the step kinds it may run inside a graph. The planner pads with the
composed policy of a model's backends; :func:`check` verifies a padded plan.

``get_policy``/``available``/``register_policy`` read the backend registry (``fullgraph.registry``):
a policy exists as its backend's attribute, never on its own.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import registry
from .fields import CORE_FIELDS, REPEAT_LAST, Field, FieldTable, StepPlan, TailRule, check_tail_rule
from .invariants import PlanInvariantError

__all__ = ["PaddingPolicy", "PlanInvariantError", "REPEAT_LAST", "available", "check", "compose", "get_policy",
           "register_policy", "tail_fill"]

# The core table's names, by role (kept for callers of the first API).
METADATA_FIELDS = CORE_FIELDS.metadata
MODEL_FIELDS = tuple(n for n, f in CORE_FIELDS.items() if f.role == "model")
FIELDS = MODEL_FIELDS + METADATA_FIELDS
DEFAULT_TAILS: Mapping[str, TailRule] = types.MappingProxyType({n: f.tail for n, f in CORE_FIELDS.items()})
STEP_KINDS = frozenset({"mixed", "decode"})


@dataclass(frozen=True)
class PaddingPolicy:
    """What one attention backend needs from the padded plan.

    Attributes:
        name: the backend's name.
        reads: the metadata fields the backend reads (built only when some backend reads them).
        tails: overrides of the fields' default tails (field -> constant or ``REPEAT_LAST``).
        graph_steps: step kinds the backend may run inside a captured graph ("mixed", "decode").
        fields: extra step fields the backend owns (``role="metadata"``, usually
            ``source="backend"``: its ``prepare`` hook fills their real rows each step).
    """

    name: str
    reads: frozenset[str]
    tails: Mapping[str, TailRule] = field(default_factory=dict)
    graph_steps: frozenset[str] = STEP_KINDS
    fields: tuple[Field, ...] = ()

    def __post_init__(self) -> None:
        table = CORE_FIELDS.extended(self.fields)
        reads = frozenset(self.reads)
        unknown = reads - set(table.metadata)
        if unknown:
            raise ValueError(f"policy {self.name!r} reads unknown metadata fields {sorted(unknown)}; "
                             f"the runner builds {list(table.metadata)} (declare new ones in `fields`)")
        bad_tails = set(self.tails) - set(table)
        if bad_tails:
            raise ValueError(f"policy {self.name!r}: tails for unknown fields {sorted(bad_tails)}")
        for name, rule in self.tails.items():
            check_tail_rule(f"{self.name}.{name}", rule)
        steps = frozenset(self.graph_steps)
        if not steps <= STEP_KINDS:
            raise ValueError(f"policy {self.name!r}: graph_steps must be a subset of {sorted(STEP_KINDS)}")
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "graph_steps", steps)
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "tails", types.MappingProxyType(
            {**{n: f.tail for n, f in table.items()}, **self.tails}))

    @property
    def table(self) -> FieldTable:
        """The step fields a plan under this policy holds: the core table and the policy's own."""
        return CORE_FIELDS.extended(self.fields)

    def tail(self, name: str) -> TailRule:
        return self.tails[name]

    def allows_graph(self, decode_only: bool) -> bool:
        return ("decode" if decode_only else "mixed") in self.graph_steps


def get_policy(name: str) -> PaddingPolicy:
    """The padding policy of the registered attention backend ``name``."""
    try:
        return registry.get(name).policy
    except ValueError:
        raise ValueError(f"no padding policy named {name!r} (no such attention backend); "
                         f"registered: {available()}") from None


def available() -> list[str]:
    return registry.names()


def register_policy(policy: PaddingPolicy, *, replace: bool = False) -> PaddingPolicy:
    """Set the policy of the registered backend of the same name (a policy lives on its backend:
    ``register_backend`` registers both). A different policy for a backend that has one needs
    ``replace=True``."""
    backend = registry.get(policy.name)
    if backend.policy != policy and not replace:
        raise ValueError(f"a padding policy named {policy.name!r} is already registered (backend "
                         f"{backend.__qualname__}); pass replace=True to change it")
    backend.policy = policy
    return policy


def compose(*policies: PaddingPolicy) -> PaddingPolicy:
    """One policy satisfying every backend of a model.

    Reads and fields are united, graph support intersected. A field's tail must agree among the
    policies that read it (fields no backend reads as metadata: among all); a disagreement is a
    ``ValueError`` naming both policies and the field.
    """
    if not policies:
        raise ValueError("compose() needs at least one policy")
    if len(policies) == 1:
        return policies[0]
    table = CORE_FIELDS.extended(f for p in policies for f in p.fields)
    tails: dict[str, TailRule] = {}
    owner: dict[str, str] = {}
    for policy in policies:
        own = {f.name for f in policy.fields}
        for name in policy.tails:
            if table[name].role == "metadata" and name not in policy.reads and name not in own:
                continue
            rule = policy.tail(name)
            if name in tails and tails[name] != rule:
                raise ValueError(f"padding policies {owner[name]!r} and {policy.name!r} conflict on {name}: "
                                 f"{tails[name]!r} vs {rule!r}")
            tails.setdefault(name, rule)
            owner.setdefault(name, policy.name)
    return PaddingPolicy(name="+".join(p.name for p in policies), reads=frozenset().union(*(p.reads for p in policies)),
                         tails=tails, graph_steps=frozenset.intersection(*(p.graph_steps for p in policies)),
                         fields=tuple(f for n, f in table.items() if n not in CORE_FIELDS))


def tail_fill(rule: TailRule, last):
    """The value a tail holds: the rule's constant, or ``last`` (the last real value)."""
    return last if rule == REPEAT_LAST else rule


def _check_tail(plan: StepPlan, name: str, start: int, rule: TailRule) -> None:
    arr = plan.arrays[name]
    if rule is None or start >= len(arr) or (rule == REPEAT_LAST and start == 0):
        return
    fill = arr[start - 1] if rule == REPEAT_LAST else rule
    off = arr[start:] != fill
    if off.any():
        index = tuple(int(i) for i in np.argwhere(off)[0])
        index = (start + index[0],) + index[1:]
        where = index[0] if len(index) == 1 else index
        expected = f"the policy's tail {fill!r}" if rule != REPEAT_LAST else f"the last real value {fill!r} (tail)"
        raise PlanInvariantError(name, where, arr[index].item(), expected)


def check(plan: StepPlan, policy: PaddingPolicy) -> None:
    """Raise :class:`PlanInvariantError` (field, index, value) if ``plan`` breaks an invariant:
    a tail that is not the policy's (``slot_mapping``'s is always -1: padding never writes the
    cache), or a field's own invariant (``Field.check``)."""
    nt, nr = plan.num_tokens, plan.num_reqs
    for name, f in plan.fields.items():
        if f.axis != "step":
            rule = -1 if name == "slot_mapping" else policy.tails.get(name, f.tail)
            _check_tail(plan, name, f.real_rows(nt, nr), rule)
        if f.check is not None:
            f.check(plan)

