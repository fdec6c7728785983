"""chunks -> StepPlan: the pure host function that validates a step and lays out its arrays.

No torch, no device work: numpy only, vectorised. The padded plan is exactly what the static
buffers will hold, and a runner has it written straight into its staging area (``out``).

Planning is serial with an idle GPU, and for a decode batch each numpy call (~0.5 us) costs more
than its data: valid steps pay for one fused check, and a step whose chunks all have one token
(the common serving step) has its own path, with no sums or repeats over chunks. A runner also
keeps a ``BlockIdCache``: the previous step's block ids, so an unchanged list is not converted again.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .block_ids import BlockIdCache, IdsError, all_ints, flatten_ids, is_int
from .config import RunnerConfig
from .fields import CORE_FIELDS, REPEAT_LAST, FieldTable, StepPlan
from .padding import PaddingPolicy

_FEW = 4  # up to this many decode chunks, per-chunk slices and Python ints beat building index arrays


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one request in one step.

    Attributes:
        token_ids: the tokens to run (a prefill chunk, or one decode token).
        start_pos: position of the first of them (= tokens of this request already in the cache).
        block_ids: the request's KV-cache pages, in order, covering positions
            ``0 .. start_pos + len(token_ids) - 1`` (more may be passed; none may be the null block 0).
        request_id: optional name used in error messages.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]
    request_id: Hashable | None = None


def array_shapes(num_tokens: int, num_reqs: int, max_blocks_per_seq: int,
                 fields: FieldTable = CORE_FIELDS) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each plan array for T tokens and R requests (the static buffers hold the maxima)."""
    return fields.shapes(num_tokens, num_reqs, max_blocks_per_seq)


def _who(chunks: Sequence[SeqChunk], i: int) -> str:
    rid = chunks[i].request_id
    return f"chunk {i}" + (f" (request {rid!r})" if rid is not None else "")


def _fail(chunks: Sequence[SeqChunk], bad: np.ndarray, field: str, message) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{_who(chunks, i)}: {field}: {message(i)}")


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= num_tokens, or None when the step is larger than every bucket."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def _gather(chunks: Sequence[SeqChunk], tok_lists: list[Sequence[int]], q_list: list[int], config: RunnerConfig,
            num_blocks: int, vocab_size: int | None, shared: np.ndarray | None):
    """The chunks of a mixed step as arrays, validated: ``(q_lens, starts, ends, n_blocks, tokens,
    blocks, max_seq_len)``.

    One fused check on the fast path (Python's builtins over the per-chunk lists, one reduction per
    range; ``int()`` truncates as the int64 conversion does); only when it fails does ``_explain``
    find the first offending chunk and field.
    """
    blk_lists = [c.block_ids for c in chunks]
    nb_list = list(map(len, blk_lists))
    total, q_min = sum(q_list), min(q_list)
    start_list = [c.start_pos for c in chunks]
    starts, n_blocks = np.array(start_list, np.int64), np.array(nb_list, np.int64)
    tokens, blocks = flatten_ids(tok_lists, total), flatten_ids(blk_lists, sum(nb_list))
    q_lens = np.array(q_list, np.int64)
    ends = starts + q_lens
    max_seq_len = int(ends.max())
    ok = (total <= config.max_num_tokens and q_min > 0 and max(nb_list) <= config.max_blocks_per_seq
          and int(min(start_list)) >= 0 and max_seq_len <= config.max_model_len
          and (n_blocks * config.block_size >= ends).all() and _in_range(blocks, 1, num_blocks)
          and (vocab_size is None or _in_range(tokens, 0, vocab_size)) and _distinct(blocks, num_blocks, shared))
    if not ok:
        _explain(chunks, config, num_blocks, vocab_size, q_lens, starts, n_blocks, tokens, blocks, shared)
    return q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len


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


def _plan_decode(chunks: Sequence[SeqChunk], tok_lists: list[Sequence[int]], config: RunnerConfig, target: Target,
                 pad: bool, num_blocks: int, vocab_size: int | None, cache: BlockIdCache | None, shared) -> StepPlan:
    """``plan_step`` of a decode-only step (every chunk has one token, so token i is chunk i's):
    the same checks and arrays, with each chunk's position and page found once."""
    n, bs = len(chunks), config.block_size
    blk_lists = [c.block_ids for c in chunks]
    nb_list = list(map(len, blk_lists))
    starts, tokens = np.array([c.start_pos for c in chunks], np.int64), flatten_ids(tok_lists, n)
    if cache is None:
        blocks, table, checked = flatten_ids(blk_lists, sum(nb_list)), None, False
    else:
        blocks, table, checked = cache.lookup(blk_lists, sum(nb_list), num_blocks, config.max_blocks_per_seq)
    start_list = starts.tolist()  # the values the arrays hold, as Python ints
    pages = [s // bs for s in start_list]
    max_seq_len = max(start_list) + 1
    ok = (max(nb_list) <= config.max_blocks_per_seq and min(start_list) >= 0 and max_seq_len <= config.max_model_len
          and all(map(int.__lt__, pages, nb_list)) and (vocab_size is None or _in_range(tokens, 0, vocab_size))
          and (checked or (_in_range(blocks, 1, num_blocks) and _distinct(blocks, num_blocks, shared))))
    if not ok:
        _explain(chunks, config, num_blocks, vocab_size, np.ones(n, np.int64), starts, np.array(nb_list, np.int64),
                 tokens, blocks, shared)
    if cache is not None:
        cache.commit()
    t_pad, r_pad = _padded_sizes(n, n, config, pad)
    return _layout_decode(starts, start_list, pages, tokens, blocks, table, nb_list, max_seq_len, config, target,
                          t_pad, r_pad, num_blocks)


def _layout_decode(starts, start_list: list[int], pages: list[int], tokens, blocks, table, nb_list: list[int],
                   max_seq_len: int, config: RunnerConfig, target: Target, t_pad: int, r_pad: int,
                   num_blocks: int) -> StepPlan:
    """``_layout`` of a checked decode step: each chunk's one token sits at its ``start_pos``.
    ``table``: the real rows of the block table, ready (from a ``BlockIdCache``), or None."""
    n, bs = len(start_list), config.block_size
    arrays = _views(target.arrays(t_pad, r_pad, config), target.fields, t_pad, r_pad)
    input_ids, positions, slots = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
    qsl, ssl, seq_lens = arrays["query_start_loc"], arrays["seq_start_loc"], arrays["seq_lens"]
    block_table, logits_indices = arrays["block_table"], arrays["logits_indices"]

    input_ids[:n] = tokens
    positions[:n] = starts
    seq_lens[:n] = ends = starts + 1
    ssl[0] = 0
    ssl[1: n + 1] = ends.cumsum()
    qsl[: n + 1] = rows = np.arange(n + 1)
    logits_indices[:n] = rows[:n]
    first = list(itertools.accumulate(nb_list, initial=0))  # chunk r's ids start at blocks[first[r]]
    if table is not None:
        block_table[:n] = table
    elif n <= _FEW:
        for row, f, nb in zip(block_table, first, nb_list):
            row[:nb] = blocks[f: f + nb]
            row[nb:] = 0  # a real row's unused pages: the null block
    else:
        block_table[:n] = 0
        # the mask's row-major order is the order of the chunks' block lists, concatenated
        block_table[:n][np.arange(block_table.shape[1]) < np.array(nb_list)[:, None]] = blocks
    if n <= _FEW:
        slots[:n] = [int(blocks[f + p]) * bs + s % bs for f, p, s in zip(first, pages, start_list)]
    else:
        page = starts // bs
        slots[:n] = (block_table[rows[:n], page] - page) * bs + starts  # block * bs + offset, in int64
    _finish(arrays, target, n, n)
    return StepPlan.make(target.fields, arrays, num_reqs=n, num_tokens=n, num_reqs_padded=r_pad,
                         num_tokens_padded=t_pad, decode_only=True, max_query_len=1, max_seq_len=max_seq_len,
                         block_size=bs, num_blocks=num_blocks)


def _views(out: Mapping[str, np.ndarray], fields: FieldTable, t_pad: int, r_pad: int) -> dict[str, np.ndarray]:
    """Each field's array sized to the padded step (views of ``out``, which may be larger)."""
    return {name: out[name][: f.real_rows(t_pad, r_pad)] for name, f in fields.items()}


def _finish(arrays: Mapping[str, np.ndarray], target: Target, nt: int, nr: int) -> None:
    """The real rows of the fields a caller or backend fills (given values or defaults), then every
    padded tail past ``nt`` tokens and ``nr`` requests (none where the step fills its bucket)."""
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
    tails = target.policy.tails
    for name, f in target.fields.items():
        arr = arrays[name]
        start = f.real_rows(nt, nr)
        if start < len(arr) and f.axis != "step":
            rule = tails.get(name, f.tail)
            if rule is not None:
                arr[start:] = arr[start - 1] if rule == REPEAT_LAST else rule


def _explain_types(chunks: Sequence[SeqChunk]) -> None:
    """Raise the ValueError naming the first chunk and field whose type is wrong."""
    for i, c in enumerate(chunks):
        if not isinstance(c, SeqChunk):
            raise ValueError(f"chunk {i}: expected a SeqChunk, got {type(c).__name__} {c!r:.60}")
        for field, ids in (("token_ids", c.token_ids), ("block_ids", c.block_ids)):
            if isinstance(ids, np.ndarray):
                if ids.ndim != 1 or ids.dtype.kind not in "iu":
                    raise ValueError(f"{_who(chunks, i)}: {field}: expected a 1-D integer array, got {ids.dtype} "
                                     f"{ids.shape}")
                continue
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(f"{_who(chunks, i)}: {field}: expected a list of ints, got {type(ids).__name__} "
                                 f"{ids!r:.40}")
            bad = [v for v in ids if not is_int(v)]
            if bad:
                raise ValueError(f"{_who(chunks, i)}: {field}: expected ints, got {type(bad[0]).__name__} {bad[0]!r:.40} "
                                 "(floats, bools and strings are refused, never rounded)")
        if not is_int(c.start_pos):
            raise ValueError(f"{_who(chunks, i)}: start_pos: expected an int, got {type(c.start_pos).__name__} "
                             f"{c.start_pos!r:.40}")


def _in_range(values: np.ndarray, lo: int, hi: int) -> bool:
    """Whether every value lies in ``[lo, hi)``: one reduction, as an unsigned comparison in which
    a value below ``lo`` wraps around to a huge one."""
    return bool(((values - lo) if lo else values).view(np.uint64).max() < hi - lo)


def _distinct(blocks: np.ndarray, num_blocks: int, shared: np.ndarray | None = None) -> bool:
    """Whether no id (in ``[0, num_blocks)``) repeats but those ``shared`` marks (cached pages: never
    written). Every id writes its index into a scratch table and a repeated id keeps only its last
    index: linear in ``len(blocks)``, unlike a sort or a ``bincount``; no initialisation needed."""
    index = np.arange(len(blocks), dtype=np.int32)
    last = np.empty(num_blocks, np.int32)
    last[blocks] = index
    return bool((last[blocks] == index).all() if shared is None else ((last[blocks] == index) | shared[blocks]).all())


def _explain(chunks, config, num_blocks, vocab_size, q_lens, starts, n_blocks, tokens, blocks, shared=None) -> None:
    """Raise the ValueError for the first problem, in a fixed order of checks."""
    n = len(chunks)
    _fail(chunks, q_lens == 0, "token_ids", lambda i: "empty chunk (a chunk needs at least one token)")
    total = int(q_lens.sum())
    if total > config.max_num_tokens:
        raise ValueError(f"{total} tokens in one step: more than max_num_tokens = {config.max_num_tokens}")
    ends = starts + q_lens
    _fail(chunks, starts < 0, "start_pos", lambda i: f"{starts[i]} is negative")
    _fail(chunks, ends > config.max_model_len, "start_pos",
          lambda i: f"start_pos {starts[i]} + {q_lens[i]} tokens = {ends[i]} exceeds max_model_len = {config.max_model_len}")
    need = -(-ends // config.block_size)
    _fail(chunks, n_blocks < need, "block_ids",
          lambda i: f"{n_blocks[i]} blocks cover {n_blocks[i] * config.block_size} positions; "
                    f"positions up to {ends[i] - 1} need {need[i]} (block_size {config.block_size})")
    mb = config.max_blocks_per_seq
    _fail(chunks, n_blocks > mb, "block_ids",
          lambda i: f"{n_blocks[i]} blocks: more than max_blocks_per_seq = {mb} (max_model_len / block_size)")
    tok_owner = np.repeat(np.arange(n), q_lens)
    blk_owner = np.repeat(np.arange(n), n_blocks)
    if vocab_size is not None:
        bad = (tokens < 0) | (tokens >= vocab_size)
        _fail(chunks, np.bincount(tok_owner[bad], minlength=n) > 0, "token_ids",
              lambda i: f"token id {tokens[bad & (tok_owner == i)][0]} outside the vocabulary [0, {vocab_size})")
    bad = (blocks <= 0) | (blocks >= num_blocks)
    _fail(chunks, np.bincount(blk_owner[bad], minlength=n) > 0, "block_ids",
          lambda i: f"block id {blocks[bad & (blk_owner == i)][0]} is the null block or outside [1, {num_blocks})")
    order = np.argsort(blocks, kind="stable")
    same = blocks[order][1:] == blocks[order][:-1]
    dup = np.flatnonzero(same if shared is None else same & ~shared[blocks[order][1:]])
    if dup.size:
        a, b = order[dup[0]], order[dup[0] + 1]
        other = "the same chunk" if blk_owner[a] == blk_owner[b] else _who(chunks, int(blk_owner[a]))
        raise ValueError(f"{_who(chunks, int(blk_owner[b]))}: block_ids: block {blocks[b]} is also used by {other}")
    raise AssertionError("_explain found no problem the fast check reported")


def _padded_sizes(num_tokens: int, num_reqs: int, config: RunnerConfig, pad: bool) -> tuple[int, int]:
    """(tokens, requests) of the step as laid out: its bucket and ``config.padded_num_reqs`` of it
    when ``pad`` (a step above every bucket keeps its own token count), else its own sizes."""
    if not pad:
        return num_tokens, num_reqs
    bucket = bucket_for(num_tokens, config.buckets)
    t_pad = num_tokens if bucket is None else bucket
    return t_pad, config.padded_num_reqs(t_pad)


def plan_step(chunks: Sequence[SeqChunk], config: RunnerConfig, policy: PaddingPolicy, *,
              pad: bool = True, num_blocks: int | None = None, vocab_size: int | None = None,
              out: Mapping[str, np.ndarray] | None = None, fields: FieldTable | None = None,
              values: Mapping[str, Sequence] | None = None) -> StepPlan:
    """Validate ``chunks`` and lay out one step, padded to its bucket with ``policy`` when ``pad``.

    ``num_blocks`` defaults to ``config.num_blocks`` (pass the resolved value when that is None).
    ``out``: arrays to write the plan into instead of new ones (a runner's staging area), each at
    least as large as ``array_shapes`` of the padded step; the plan's arrays are then views of them.
    ``fields``: the step fields to lay out (default: ``policy.table``, the core fields and the
    policy's own); ``values``: the real rows of fields whose ``source`` is "caller", one value per
    chunk (unset: the field's default).
    Raises ``ValueError`` naming the chunk and field for any bad input, before anything is written.
    """
    target = Target(fields or policy.table, policy, values, out)
    return plan_with_cache(chunks, config, target, pad, num_blocks, vocab_size, None)


def plan_with_cache(chunks: Sequence[SeqChunk], config: RunnerConfig, target: Target, pad: bool,
                    num_blocks: int | None, vocab_size: int | None, cache: BlockIdCache | None,
                    shared: np.ndarray | None = None) -> StepPlan:
    """``plan_step`` for a runner: its ``Target`` built once, a ``BlockIdCache`` kept across steps; ``shared``
    (``BlockAllocator.shared_pages()``): a bool mask of block ids several chunks may name (cached pages)."""
    num_blocks = num_blocks or config.num_blocks
    if num_blocks is None:
        raise ValueError("plan_step needs num_blocks: pass it, or use the runner's resolved config")
    if not isinstance(chunks, (list, tuple)):
        raise ValueError(f"chunks: expected a list of SeqChunk, got {type(chunks).__name__} "
                         "(a single chunk goes in a list: [chunk])")
    n = len(chunks)
    if n == 0:
        raise ValueError("a step needs at least one chunk")
    if n > config.max_num_seqs:
        raise ValueError(f"{n} chunks in one step: more than max_num_seqs = {config.max_num_seqs}")
    try:  # the happy path pays one C-speed type pass; any surprise is explained below
        tok_lists = [c.token_ids for c in chunks]
        q_list = list(map(len, tok_lists))
        if not (all_ints(itertools.chain.from_iterable(tok_lists)) and all_ints(c.start_pos for c in chunks)):
            _explain_types(chunks)
        if q_list.count(1) == n:
            return _plan_decode(chunks, tok_lists, config, target, pad, num_blocks, vocab_size, cache, shared)
        gathered = _gather(chunks, tok_lists, q_list, config, num_blocks, vocab_size, shared)
    except (AttributeError, TypeError, IdsError):
        _explain_types(chunks)
        raise
    q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len = gathered
    t_pad, r_pad = _padded_sizes(len(tokens), n, config, pad)
    return _layout(q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len, config, target, t_pad, r_pad,
                   num_blocks)


def capture_plan(config: RunnerConfig, target: Target | PaddingPolicy, num_blocks: int, num_tokens: int,
                 decode_only: bool, num_reqs: int | None = None) -> StepPlan:
    """A plan to capture the graph of one key with: short sequences that read only the null block
    and write nothing (every slot -1), so capture neither depends on nor touches the cache.
    ``num_reqs`` (default: as many as the bucket pads to) spreads the tokens over that many."""
    if isinstance(target, PaddingPolicy):
        target = Target(target.table, target, None, None)
    target = Target(target.fields, target.policy, target.values, None)  # fresh arrays, never the staging area
    r_pad = config.padded_num_reqs(num_tokens) if num_reqs is None else num_reqs
    q_lens = np.full(r_pad, num_tokens // r_pad, np.int64)
    q_lens[: num_tokens % r_pad] += 1
    n_blocks = -(-q_lens // config.block_size)
    blocks = np.zeros(int(n_blocks.sum()), np.int64)
    plan = _layout(None if r_pad == num_tokens else q_lens, np.zeros(r_pad, np.int64), q_lens, n_blocks,
                   np.zeros(num_tokens, np.int64), blocks, int(q_lens.max()), config, target, num_tokens, r_pad,
                   num_blocks)
    plan.slot_mapping[:] = -1
    return plan.replace(decode_only=decode_only)


def _layout(q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len: int, config: RunnerConfig,
            target: Target, t_pad: int, r_pad: int, num_blocks: int) -> StepPlan:
    """Write the padded step into the target's arrays. ``q_lens`` None: token i is chunk i's only token."""
    nr, nt, bs = len(starts), len(tokens), config.block_size
    arrays = _views(target.arrays(t_pad, r_pad, config), target.fields, t_pad, r_pad)
    input_ids, positions, slots = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
    qsl, ssl, seq_lens = arrays["query_start_loc"], arrays["seq_start_loc"], arrays["seq_lens"]
    block_table, logits_indices = arrays["block_table"], arrays["logits_indices"]

    qsl[0] = ssl[0] = 0
    if q_lens is None:
        rows = np.arange(nr)  # each token's chunk
        qsl[1: nr + 1] = rows + 1
        positions[:nt] = starts
    else:
        cu_q = q_lens.cumsum()
        rows = np.repeat(np.arange(nr), q_lens)
        qsl[1: nr + 1] = cu_q
        positions[:nt] = np.arange(nt) + (starts - (cu_q - q_lens))[rows]
    ssl[1: nr + 1] = ends.cumsum()
    seq_lens[:nr] = ends
    logits_indices[:nr] = qsl[1: nr + 1] - 1
    input_ids[:nt] = tokens
    block_table[:nr] = 0  # a real row's unused pages: the null block
    # the mask's row-major order is the order of the chunks' block lists, concatenated
    block_table[:nr][np.arange(block_table.shape[1]) < n_blocks[:, None]] = blocks
    page = positions[:nt] // bs
    slots[:nt] = (block_table[rows, page] - page) * bs + positions[:nt]  # block * bs + offset, in int64

    _finish(arrays, target, nt, nr)
    return StepPlan.make(target.fields, arrays, num_reqs=nr, num_tokens=nt, num_reqs_padded=r_pad,
                         num_tokens_padded=t_pad, decode_only=q_lens is None,
                         max_query_len=1 if q_lens is None else int(q_lens.max()), max_seq_len=max_seq_len,
                         block_size=bs, num_blocks=num_blocks)
