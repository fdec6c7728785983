"""StepInputs -> StepPlan: the last stage of planning (``layout``), writing a checked step's padded
arrays into a ``Target``'s (a runner's staging area, or new ones).

For a decode batch each numpy call (~0.5 us) costs more than its data, so a decode step (token r is
chunk r's only token) skips the repeats over chunks, and a step of a few chunks fills its block-table
rows (and a decode step its slots) with slices and Python ints rather than index arrays.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .chunks import FEW, StepInputs
from .config import RunnerConfig
from .fields import REPEAT_LAST, FieldTable, StepPlan
from .padding import PaddingPolicy


class Target(NamedTuple):
    """Where and how a plan is laid out: its field table, padding policy, caller values for the
    fields the caller fills (field -> one value per chunk), and the arrays to write (or None: new
    ones). A tuple, so a runner builds one per step for next to nothing."""

    fields: FieldTable
    policy: PaddingPolicy
    values: Mapping[str, Sequence] | None
    out: Mapping[str, np.ndarray] | None

    def arrays(self, t_pad: int, r_pad: int, config: RunnerConfig) -> Mapping[str, np.ndarray]:
        if self.out is not None:
            return self.out
        return self.fields.new_arrays(t_pad, r_pad, config.max_blocks_per_seq)


def layout(inputs: StepInputs, config: RunnerConfig, target: Target, t_pad: int, r_pad: int,
           num_blocks: int) -> StepPlan:
    """Write the step into the target's arrays, padded to ``t_pad`` tokens and ``r_pad`` requests.
    A decode step (``inputs.q_lens`` None) is a branch here, not a layout of its own."""
    q_lens, starts, ends, tokens, blocks, n_blocks, max_seq_len, table = inputs
    nr, nt, bs = len(starts), len(tokens), config.block_size
    arrays = _views(target.arrays(t_pad, r_pad, config), target.fields, t_pad, r_pad)
    input_ids, positions, slots = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
    qsl, ssl, seq_lens = arrays["query_start_loc"], arrays["seq_start_loc"], arrays["seq_lens"]
    block_table, logits_indices = arrays["block_table"], arrays["logits_indices"]

    if q_lens is None:  # a decode step: token r is chunk r's only token, at its start_pos
        cu_q = np.arange(nr + 1)
        qsl[: nr + 1] = cu_q
        rows = cu_q[:nr]  # each token's chunk, and each chunk's last token
        logits_indices[:nr] = rows
        positions[:nt] = starts
    else:
        cu_q = q_lens.cumsum()
        qsl[0] = 0
        qsl[1: nr + 1] = cu_q
        logits_indices[:nr] = cu_q - 1
        rows = np.arange(nr).repeat(q_lens)  # each token's chunk
        positions[:nt] = np.arange(nt) + (starts - (cu_q - q_lens))[rows]
    seq_lens[:nr] = ends
    ssl[0] = 0
    ssl[1: nr + 1] = ends.cumsum()
    input_ids[:nt] = tokens
    _block_rows(block_table[:nr], blocks, n_blocks, table)
    if q_lens is None and nr <= FEW:  # block * bs + offset, a few Python ints
        slots[:nt] = [int(block_table[r, s // bs]) * bs + s % bs for r, s in enumerate(starts.tolist())]
    else:
        page = positions[:nt] // bs
        slots[:nt] = (block_table[rows, page] - page) * bs + positions[:nt]  # block * bs + offset, in int64

    _filled(arrays, target, nt, nr)
    if (nt, nr) != (t_pad, r_pad):
        _tails(arrays, target, nt, nr)
    return StepPlan.make(target.fields, arrays, num_reqs=nr, num_tokens=nt, num_reqs_padded=r_pad,
                         num_tokens_padded=t_pad, decode_only=q_lens is None,
                         max_query_len=1 if q_lens is None else int(q_lens.max()), max_seq_len=max_seq_len,
                         block_size=bs, num_blocks=num_blocks)


def _block_rows(block_table: np.ndarray, blocks: np.ndarray, n_blocks: np.ndarray, table: np.ndarray | None) -> None:
    """The real rows of the block table: each chunk's ids, then the null block 0 on its unused pages.
    ``table``: the rows ready (from a ``BlockIdCache``), or None."""
    if table is not None:
        block_table[:] = table
    elif len(n_blocks) <= FEW:
        first = 0
        for row, nb in zip(block_table, n_blocks.tolist()):
            row[:nb] = blocks[first: first + nb]
            row[nb:] = 0
            first += nb
    else:
        block_table[:] = 0
        # the mask's row-major order is the order of the chunks' block lists, concatenated
        block_table[np.arange(block_table.shape[1]) < n_blocks[:, None]] = blocks


class Staging(dict):
    """A runner's staging arrays (field name -> max-size array), which keep the views ``layout``
    cuts from them: the same arrays every step, so each bucket's views are made once (a slice per
    field costs ~5 us a step), and they go when the runner goes."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().__init__(arrays)
        self.views: dict[tuple[int, int, int], tuple[FieldTable, dict[str, np.ndarray]]] = {}


def _views(out: Mapping[str, np.ndarray], fields: FieldTable, t_pad: int, r_pad: int) -> dict[str, np.ndarray]:
    """Each field's array sized to the padded step (views of ``out``, which may be larger). A
    ``Staging`` area keeps them per bucket, shared by that bucket's plans, whose arrays are the
    staging area's anyway (the next step rewrites them)."""
    cache = out.views if isinstance(out, Staging) else None
    if cache is not None:
        hit = cache.get((id(fields), t_pad, r_pad))
        if hit is not None and hit[0] is fields:
            return hit[1]
    views = {name: out[name][: f.real_rows(t_pad, r_pad)] for name, f in fields.items()}
    if cache is not None:
        cache[(id(fields), t_pad, r_pad)] = (fields, views)   # the entry holds fields: its id stays its own
    return views


def _filled(arrays: Mapping[str, np.ndarray], target: Target, nt: int, nr: int) -> None:
    """The real rows of the fields a caller or backend fills: the given values, or the defaults."""
    values = target.values or {}
    for f in target.fields.filled:
        given, rows = values.get(f.name), f.real_rows(nt, nr)
        if given is None and f.source == "host":
            continue  # a big field its owner writes only when it has something to say
        if given is not None and len(given) != rows:
            raise ValueError(f"values[{f.name!r}]: {len(given)} values for a step of {nr} chunks / {nt} tokens "
                             f"(one per {'token' if f.axis == 'token' else 'chunk'}: {rows})")
        if given is not None and f.width and np.shape(given)[1:] != (f.width,):
            raise ValueError(f"values[{f.name!r}]: rows of shape {np.shape(given)[1:]}, expected ({f.width},)")
        arrays[f.name][:rows] = f.default if given is None else given


def _tails(arrays: Mapping[str, np.ndarray], target: Target, nt: int, nr: int) -> None:
    """Every padded tail past ``nt`` tokens and ``nr`` requests, by the policy's rule or the field's."""
    tails = target.policy.tails
    for name, f in target.fields.items():
        arr = arrays[name]
        start = f.real_rows(nt, nr)
        if start < len(arr) and f.axis != "step":
            rule = tails.get(name, f.tail)
            if rule is not None:
                arr[start:] = arr[start - 1] if rule == REPEAT_LAST else rule
