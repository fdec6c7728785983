"""A step's chunks, checked and read into flat arrays: the first stage of planning (``read_chunks``).

The one stage that checks the caller's ``SeqChunk`` objects: types, sizes, limits, ids in range,
distinct pages. A valid step pays for one type pass and one fused check (Python's builtins over
per-chunk lists, one reduction per range); only a failing step is looked at again, by
``_explain_types`` or ``_explain``, which name the first offending chunk and field.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .block_ids import BlockIdCache, IdsError, all_ints, flatten_ids, is_int
from .config import RunnerConfig

FEW = 4  # up to this many chunks, per-chunk Python ints and slices beat building and reducing arrays


@dataclass(frozen=True, init=False)
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

    def __init__(self, token_ids: Sequence[int], start_pos: int, block_ids: Sequence[int],
                 request_id: Hashable | None = None) -> None:
        # frozen, but filled through the instance dict: a frozen dataclass's own __init__ sets each
        # field with object.__setattr__ (0.53 us a chunk against 0.23, VM): 256 decodes a step make 256
        d = self.__dict__
        d["token_ids"], d["start_pos"], d["block_ids"], d["request_id"] = token_ids, start_pos, block_ids, request_id


class StepInputs(NamedTuple):
    """A step's chunks after ``read_chunks``: checked, as flat int64 arrays in chunk order."""

    q_lens: np.ndarray | None   # tokens per chunk; None: one each (a decode step)
    starts: np.ndarray          # start_pos per chunk
    ends: np.ndarray            # start_pos + tokens per chunk: its sequence length after the step
    tokens: np.ndarray          # the chunks' token ids, concatenated
    blocks: np.ndarray          # the chunks' block ids, concatenated
    n_blocks: np.ndarray        # block ids per chunk
    max_seq_len: int
    table: np.ndarray | None    # the real block-table rows, int32, when a BlockIdCache had them all


def read_chunks(chunks: Sequence[SeqChunk], config: RunnerConfig, num_blocks: int, vocab_size: int | None,
                cache: BlockIdCache | None = None, shared: np.ndarray | None = None) -> StepInputs:
    """Check a step's chunks against ``config``, ``num_blocks`` and ``vocab_size`` (None: any token
    id) and read them into a ``StepInputs``; raise ``ValueError`` naming the chunk and field otherwise.

    A decode step (every chunk one token) is a variant: no sums over chunks, and its block ids come
    through ``cache``, once: a list unchanged since the last valid decode step reuses its ids and
    block-table row, and when every list does, the range and duplicate checks are known to pass; the
    cache keeps the step's lists only once it passed. ``shared``: a bool mask of the block ids
    several chunks may name (cached pages, never written).
    """
    n = _count(chunks, config)
    try:  # the happy path pays one C-speed type pass; any surprise is explained below
        tok_lists = [c.token_ids for c in chunks]
        q_list = list(map(len, tok_lists))
        if not (all_ints(itertools.chain.from_iterable(tok_lists)) and all_ints(c.start_pos for c in chunks)):
            _explain_types(chunks)
        decode = q_list.count(1) == n
        cache = cache if decode else None  # a decode step's lists are mostly the last one's; a prefill's are new
        blk_lists = [c.block_ids for c in chunks]
        nb_list = list(map(len, blk_lists))
        start_list = [c.start_pos for c in chunks]
        starts = np.array(start_list, np.int64)
        tokens = flatten_ids(tok_lists, n if decode else sum(q_list))
        if cache is None:
            blocks, table, checked = flatten_ids(blk_lists, sum(nb_list)), None, False
        else:
            blocks, table, checked = cache.lookup(blk_lists, sum(nb_list), num_blocks, config.max_blocks_per_seq,
                                                  shared)
    except (AttributeError, TypeError, IdsError):
        _explain_types(chunks)
        raise
    n_blocks, bs = np.array(nb_list, np.int64), config.block_size
    # fits: every token on a page given (and a mixed step's sizes within the limits)
    if decode:
        start_list = starts.tolist()  # the values the array holds, as Python ints
        q_lens, ends, max_seq_len = None, starts + 1, max(start_list) + 1
        fits = (all(map(int.__lt__, [s // bs for s in start_list], nb_list)) if n <= FEW
                else _all(n_blocks * bs >= ends))
    else:
        q_lens = np.array(q_list, np.int64)
        ends = starts + q_lens
        max_seq_len = int(ends.max())
        fits = len(tokens) <= config.max_num_tokens and min(q_list) > 0 and _all(n_blocks * bs >= ends)
    ok = (fits and max(nb_list) <= config.max_blocks_per_seq and min(start_list) >= 0
          and max_seq_len <= config.max_model_len and (vocab_size is None or _tokens_in_range(tokens, tok_lists, n,
                                                                                               decode, vocab_size))
          and (checked or (_in_range(blocks, 1, num_blocks) and _distinct(blocks, num_blocks, shared))))
    if not ok:
        _explain(chunks, config, num_blocks, vocab_size, np.ones(n, np.int64) if decode else q_lens, starts,
                 n_blocks, tokens, blocks, shared)
    if cache is not None:
        cache.commit()
    return StepInputs(q_lens, starts, ends, tokens, blocks, n_blocks, max_seq_len, table)


def _count(chunks: Sequence[SeqChunk], config: RunnerConfig) -> int:
    """The number of chunks, checked: a list or tuple of 1 .. ``max_num_seqs``."""
    if not isinstance(chunks, (list, tuple)):
        raise ValueError(f"chunks: expected a list of SeqChunk, got {type(chunks).__name__} "
                         "(a single chunk goes in a list: [chunk])")
    n = len(chunks)
    if n == 0:
        raise ValueError("a step needs at least one chunk")
    if n > config.max_num_seqs:
        raise ValueError(f"{n} chunks in one step: more than max_num_seqs = {config.max_num_seqs}")
    return n


def _tokens_in_range(tokens: np.ndarray, tok_lists: list, n: int, decode: bool, vocab_size: int) -> bool:
    """Every token id in ``[0, vocab_size)``: a few decode tokens as Python ints, else one reduction."""
    if decode and n <= FEW:
        return all(0 <= ids[0] < vocab_size for ids in tok_lists)
    return _in_range(tokens, 0, vocab_size)


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
    return _all(last[blocks] == index if shared is None else (last[blocks] == index) | shared[blocks])


def _all(mask: np.ndarray) -> bool:
    """Whether a 1-D mask is all true: ``np.count_nonzero`` costs a third of ``ndarray.all`` on a small one."""
    return np.count_nonzero(mask) == len(mask)


def _who(chunks: Sequence[SeqChunk], i: int) -> str:
    rid = chunks[i].request_id
    return f"chunk {i}" + (f" (request {rid!r})" if rid is not None else "")


def _fail(chunks: Sequence[SeqChunk], bad: np.ndarray, field: str, message) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{_who(chunks, i)}: {field}: {message(i)}")


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


def check_prev_rows(rows: Sequence[int], limit: int) -> None:
    """``values['prev_token_row']``: ints, each -1 (the token keeps its own id) or a row of the
    previous step's samples in ``[0, limit)``; a ``ValueError`` naming the first other one."""
    if len(rows) and all_ints(rows) and -1 <= min(rows) and max(rows) < limit:
        return
    for t, row in enumerate(rows):
        if not is_int(row) or not -1 <= row < limit:
            raise ValueError(f"values['prev_token_row'][{t}] = {row!r:.40}: expected -1 (the token's own id) or an "
                             f"int row of the previous step's samples in [0, {limit})")
