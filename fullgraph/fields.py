"""THE table of step fields: every per-step array the planner writes and a graph reads.

A *step field* is one array of a step's plan: its name, dtype, axis (what its length counts),
the value its padded tail holds by default, and what it means. Everything else derives from this
table: the ``StepPlan`` arrays and their shapes, the pinned staging layout and device views of
``StaticBuffers``, poisoning in validate mode, tail filling, ``padding.check``, the fields of
``AttentionMetadata``, and the one mapping of tensors the model step takes. Adding a field is one
entry here (or in a backend's ``PaddingPolicy.fields``, or a runner feature's extra fields).

Axes (T = padded tokens, R = padded requests, MB = max blocks per sequence):

    ======================  ==========  =========================================
    axis                    shape       real rows
    ======================  ==========  =========================================
    ``TOKEN``               (T,)        the step's real tokens
    ``REQUEST``             (R,)        the step's real requests (chunks)
    ``REQUEST_PLUS_ONE``    (R + 1,)    cumulative offsets: real requests + 1
    ``REQUEST_BLOCKS``      (R, MB)     one row per real request
    ``REQUEST_WORDS``       (R, width)  one row per real request (``Field.width`` columns, e.g. a
                                        packed bitmask over the vocabulary)
    ``STEP``                (1,)        one value for the whole step (never padded)
    ======================  ==========  =========================================

The *tail* is what the rows past the real ones hold in a padded step ("no work" for every kernel):
an int or float constant, or ``REPEAT_LAST`` (the last real value; cumulative offsets must stay
non-decreasing), or None: rows nobody reads unless another field says so (a per-request flag),
left as they are. Pure host code: numpy only, no project imports.
"""
from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from . import invariants

REPEAT_LAST = "repeat_last"
TailRule = Union[int, float, str]  # a constant fill, or REPEAT_LAST

TOKEN, REQUEST, REQUEST_PLUS_ONE, REQUEST_BLOCKS, STEP = "token", "request", "request+1", "request_blocks", "step"
REQUEST_WORDS = "request_words"
AXES = (TOKEN, REQUEST, REQUEST_PLUS_ONE, REQUEST_BLOCKS, REQUEST_WORDS, STEP)

# Who reads a field: the model (its inputs), attention backends (metadata; built only when a
# backend declares it reads it), the runner itself (e.g. which rows become logits), or sampling.
ROLES = ("model", "metadata", "runner", "sampling")
# Who writes a field's real rows: the planner (from the chunks), the caller (per-request values
# passed to the step; the field's default otherwise), a backend's ``prepare`` hook, or the host
# owner of a big field (only when it has values: nothing is filled otherwise).
SOURCES = ("plan", "caller", "backend", "host")


@dataclass(frozen=True)
class Field:
    """One step field (see the module docstring).

    Attributes:
        name: the array's name (``StepPlan.<name>``, ``AttentionMetadata.<name>``, buffer name).
        dtype: numpy dtype of the host array and the device buffer.
        axis: one of ``AXES``.
        tail: default fill of the padded rows, ``REPEAT_LAST``, or None (left as they are; padding
            policies may override it).
        doc: what it means (one line).
        role: one of ``ROLES``.
        source: one of ``SOURCES``.
        default: value of the real rows a caller or backend leaves unset (``source != "plan"``).
        check: an invariant of a padded plan beyond its tail, ``check(plan) -> None`` raising
            ``padding.PlanInvariantError``; run by ``padding.check`` in validate mode.
        width: columns of a ``REQUEST_WORDS`` field.
    """

    name: str
    dtype: Any
    axis: str
    tail: TailRule
    doc: str
    role: str = "metadata"
    source: str = "plan"
    default: int | float = 0
    check: Callable[[Any], None] | None = field(default=None, compare=False, repr=False)
    width: int = 0

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"step field name {self.name!r} is not a Python identifier")
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.dtype.kind not in "iuf":
            raise ValueError(f"step field {self.name!r}: dtype must be an int or float type, got {self.dtype}")
        for what, value, allowed in (("axis", self.axis, AXES), ("role", self.role, ROLES),
                                     ("source", self.source, SOURCES)):
            if value not in allowed:
                raise ValueError(f"step field {self.name!r}: {what} must be one of {allowed}, got {value!r}")
        check_tail_rule(self.name, self.tail)
        if (self.axis == REQUEST_WORDS) != (self.width > 0):
            raise ValueError(f"step field {self.name!r}: a {REQUEST_WORDS} field needs width > 0 (and only it)")

    def shape(self, num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> tuple[int, ...]:
        return {TOKEN: (num_tokens,), REQUEST: (num_reqs,), REQUEST_PLUS_ONE: (num_reqs + 1,),
                REQUEST_BLOCKS: (num_reqs, max_blocks_per_seq), REQUEST_WORDS: (num_reqs, self.width),
                STEP: (1,)}[self.axis]

    def real_rows(self, num_tokens: int, num_reqs: int) -> int:
        """Rows of a step with ``num_tokens`` tokens and ``num_reqs`` requests: its real rows (given
        the real counts), or the rows of its bucket (given the padded ones). ``STEP``: its one row."""
        return {TOKEN: num_tokens, REQUEST: num_reqs, REQUEST_PLUS_ONE: num_reqs + 1,
                REQUEST_BLOCKS: num_reqs, REQUEST_WORDS: num_reqs, STEP: 1}[self.axis]


def check_tail_rule(name: str, rule: object) -> None:
    if rule is None:
        return
    if isinstance(rule, bool) or not (isinstance(rule, (int, float)) or rule == REPEAT_LAST):
        raise ValueError(f"tail of step field {name!r} must be an int, a float or {REPEAT_LAST!r}, got {rule!r}")


class FieldTable(Mapping[str, Field]):
    """An ordered, immutable set of step fields (a mapping name -> ``Field``)."""

    def __init__(self, fields: Iterable[Field]) -> None:
        table: dict[str, Field] = {}
        for f in fields:
            if f.name in table and table[f.name] != f:
                raise ValueError(f"step field {f.name!r} is declared twice, differently: {table[f.name]} vs {f}")
            table[f.name] = f
        self._fields = types.MappingProxyType(table)
        self.metadata = tuple(n for n, f in table.items() if f.role == "metadata")
        self.filled = tuple(f for f in table.values() if f.source != "plan")  # real rows: default or given

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldTable) and tuple(self._fields.values()) == tuple(other._fields.values())

    def __hash__(self) -> int:
        return hash(tuple(self._fields))

    def __repr__(self) -> str:
        return f"FieldTable({list(self._fields)})"

    def extended(self, fields: Iterable[Field]) -> FieldTable:
        """This table plus ``fields`` (a name declared again must be the same field)."""
        return FieldTable((*self._fields.values(), *fields))

    def shapes(self, num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each array for T tokens and R requests (the buffers hold the maxima)."""
        return {n: (f.shape(num_tokens, num_reqs, max_blocks_per_seq), f.dtype) for n, f in self._fields.items()}

    def new_arrays(self, num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> dict[str, np.ndarray]:
        return {n: np.empty(shape, dtype) for n, (shape, dtype) in self.shapes(num_tokens, num_reqs,
                                                                               max_blocks_per_seq).items()}


CORE_FIELDS = FieldTable([
    Field("input_ids", np.int64, TOKEN, 0, "token ids (in range for the embedding table)", role="model"),
    Field("positions", np.int64, TOKEN, 0, "position of each token in its request (in range for RoPE tables)",
          role="model"),
    Field("slot_mapping", np.int64, TOKEN, -1,
          "flat KV-cache slot of each token, block_id * block_size + offset; -1 = write nothing",
          check=invariants.slots),
    Field("query_start_loc", np.int32, REQUEST_PLUS_ONE, REPEAT_LAST,
          "cu_seqlens of the new tokens, [0, q0, q0+q1, ...]; non-decreasing",
          check=invariants.query_start_loc),
    Field("seq_start_loc", np.int32, REQUEST_PLUS_ONE, REPEAT_LAST,
          "cu_seqlens of whole sequences (context + new tokens); non-decreasing",
          check=invariants.seq_start_loc),
    Field("seq_lens", np.int32, REQUEST, 0, "context + new tokens of each request (0: a padded request)"),
    Field("block_table", np.int32, REQUEST_BLOCKS, 0, "KV pages of each request; the null block 0 where unused",
          check=invariants.block_table),
    Field("logits_indices", np.int64, REQUEST, REPEAT_LAST, "each request's last token (the row that becomes logits)",
          role="runner", check=invariants.logits_indices),
])

# The fields a sampling runner adds (``RunnerConfig(sampling=True)``): per-request parameters of the
# sampler inside the graph (padded rows: greedy), and each token's source when its id is the
# previous step's sample, which the graph then reads from its own output (no host round trip).
SAMPLING_FIELDS = (
    Field("temperature", np.float32, REQUEST, 0.0, "softmax temperature; 0: greedy", role="sampling",
          source="caller", default=0.0),
    Field("top_k", np.int32, REQUEST, -1, "keep the k most likely tokens; -1: all", role="sampling", source="caller",
          default=-1),
    Field("top_p", np.float32, REQUEST, 1.0, "keep the most likely tokens summing to top_p; 1: all", role="sampling",
          source="caller", default=1.0),
    Field("min_p", np.float32, REQUEST, 0.0, "keep tokens of at least min_p times the top probability",
          role="sampling", source="caller", default=0.0),
    Field("seed", np.int64, REQUEST, 0, "the request's random seed (counter-based: with sample_offset)",
          role="sampling", source="caller", default=0),
    Field("sample_offset", np.int64, REQUEST, 0, "the request's output position: the RNG counter", role="sampling",
          source="caller", default=0),
    Field("prev_token_row", np.int64, TOKEN, -1,
          "row of the previous step's sampled ids this token's id is; -1: its id is input_ids", role="model",
          source="caller", default=-1),
)


class StepPlan:
    """Host arrays of one step, one per field of ``fields``, padded to the step's bucket (see
    ``padding.check`` for the invariants), plus what the host knows of the step.

    Each array is an attribute (``plan.slot_mapping``) and an entry of ``plan.arrays``; shapes
    follow the field axes with T = ``num_tokens_padded``, R = ``num_reqs_padded``. Immutable:
    ``replace`` makes a changed copy.
    """

    fields: FieldTable
    arrays: Mapping[str, np.ndarray]
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int
    num_tokens_padded: int
    decode_only: bool            # every chunk has exactly one token
    max_query_len: int           # of the real chunks (host-side information)
    max_seq_len: int
    block_size: int
    num_blocks: int

    _SCALARS = ("num_reqs", "num_tokens", "num_reqs_padded", "num_tokens_padded", "decode_only", "max_query_len",
                "max_seq_len", "block_size", "num_blocks")

    @classmethod
    def make(cls, fields: FieldTable, arrays: Mapping[str, np.ndarray], **scalars) -> StepPlan:
        """Every attribute at once (the planner's constructor: no per-attribute ``__setattr__``)."""
        plan = object.__new__(cls)
        plan.__dict__.update(arrays)
        plan.__dict__.update(scalars, fields=fields, arrays=arrays)
        return plan

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"StepPlan is immutable (use plan.replace({name}=...))")

    @property
    def key(self) -> tuple[int, bool]:
        """The graph key: (padded token count, decode-only)."""
        return self.num_tokens_padded, self.decode_only

    def replace(self, **changes) -> StepPlan:
        """A copy with some arrays or scalars replaced (unknown names raise)."""
        unknown = set(changes) - set(self.fields) - set(self._SCALARS)
        if unknown:
            raise ValueError(f"StepPlan has no fields {sorted(unknown)}")
        arrays = {n: changes.get(n, a) for n, a in self.arrays.items()}
        scalars = {n: changes.get(n, getattr(self, n)) for n in self._SCALARS}
        return StepPlan.make(self.fields, arrays, **scalars)

    def __repr__(self) -> str:
        return (f"StepPlan({self.num_tokens} tokens / {self.num_reqs} requests padded to {self.num_tokens_padded} / "
                f"{self.num_reqs_padded}, decode_only={self.decode_only}, fields={list(self.fields)})")


def structured_fields(vocab_size: int) -> tuple[Field, ...]:
    """The fields a runner with structured output adds (``RunnerConfig(structured=True)``): which
    requests are constrained, and their allowed-token bitmasks (packed int32, bit ``v % 32`` of
    word ``v // 32``; rows of unconstrained and padded requests are never read, so the host writes
    only the constrained ones)."""
    return (
        Field("constrained", np.int32, REQUEST, 0, "1: apply this request's token_bitmask", role="sampling",
              source="caller", default=0),
        Field("token_bitmask", np.int32, REQUEST_WORDS, None, "allowed token ids, packed 32 to a word",
              role="sampling", source="host", width=-(-vocab_size // 32)),
    )
