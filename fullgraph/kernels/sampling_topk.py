"""The sampling kernel's path for rows with a small top-k (with or without top-p and min-p): the
few tokens that can be kept, listed by the scan pass, instead of the histograms (see
``kernels/sampling.py``).

The scan pass lists, per chunk, its ``TK`` largest scores ``s`` with their ids (exactly: each a
token of the chunk, ties by lowest id) and a bound ``U`` of every score it did not list (the
largest of what is left of each position's best and runner-up, and of its third-best: a position
sees several tokens in turn). ``L``, the k-th largest listed score, is at most ``v_k`` (the k-th
largest of a subset is at most the k-th largest of the whole), so ``{s >= L}`` holds the whole top-k
set. Then, in the level-1 launch:

- **Complete rows** (almost all): when at least k listed scores exceed every chunk's ``U``, every
  token of ``{s >= L}`` is listed and ``L = v_k``. Level 1 only marks the row (zones STATE
  ``COMPLETE``): nothing re-reads it, the next launches have nothing to do for it, and the select
  pass finds ``v_k``, ``Z_k``, ``v_p`` and the Gumbel winner among the listed scores in registers
  (kept out of level 1, whose registers the chain rows' pass shares).
  With k = 50 over 17 chunks of 16 listed scores, a chunk holding 17 of the top 50 (which would
  leave a row incomplete) is a chance of about 1e-7 a row when the top tokens fall anywhere.
- **Other rows** (a wide tie at ``L``; a chunk holding more than ``TK`` of the top-k; fewer finite
  scores than k): each program writes the ids of its chunk's tokens with ``s >= L`` to the
  candidate list the select pass reads (``cand``, one segment a chunk), re-reading the chunk, and
  the select pass finds ``v_k``, ``Z_k``, ``v_p`` and the winner over them exactly, as it does for the
  histogram path's undecided zone (with nothing surely kept above it). A row with more than
  ``cand_block`` such tokens falls back to the histogram path from the level-2 launch, as the
  chain's rows do.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sampling_chain import STATE
from .sampling_common import INT_MAX, NEG_INF, _key, _max_and_first, _raw, _scaled, _track_max, _unkey

TOP_VALUES = 16  # scores a chunk lists (k up to TOP_VALUES * chunks takes this path)
LISTED = tl.constexpr(3)     # zones STATE of a row whose candidates are listed (see sampling_chain.STATE) ...
COMPLETE = tl.constexpr(4)   # ... and of one whose chunks' lists hold them all
K_NEG_INF = tl.constexpr(-2139095041 << 32)   # _scan_values' int64 entry of -inf: _key(-inf) above id INT_MAX


@triton.jit
def _is_topk(t, top_k, vocab, num_chunks, TK: tl.constexpr):
    """Sampled rows with a top-k the chunks' lists can reach."""
    return (t > 0) & (top_k > 0) & (top_k < vocab) & (top_k <= num_chunks * TK)


@triton.jit
def _top4(a0, a1, a2, a3, b0, b1, b2, b3):
    """The four largest of two descending lists of four, descending: the pairwise maxima of one list
    and the other reversed are those four (a bitonic sequence), sorted by a four-entry network."""
    c0, c1, c2, c3 = tl.maximum(a0, b3), tl.maximum(a1, b2), tl.maximum(a2, b1), tl.maximum(a3, b0)
    c0, c2 = tl.maximum(c0, c2), tl.minimum(c0, c2)
    c1, c3 = tl.maximum(c1, c3), tl.minimum(c1, c3)
    c0, c1 = tl.maximum(c0, c1), tl.minimum(c0, c1)
    c2, c3 = tl.maximum(c2, c3), tl.minimum(c2, c3)
    return c0, c1, c2, c3


@triton.jit
def _store_entry(values, ids, i, entry):
    """A listed entry (key above INT_MAX - id) as its score and id."""
    tl.store(values + i, _unkey((entry >> 32).to(tl.int32)))
    tl.store(ids + i, (2**31 - 1 - (entry & (2**31 - 1))).to(tl.int32))


@triton.jit
def _scan_values(x_row, row_part, values, ids, bound, c, chunk, vocab, inv_t, BLOCK: tl.constexpr, TK: tl.constexpr):
    """The raw max and its lowest index (as for every row); the chunk's TK largest scores ``s`` with
    their ids, and the bound ``U`` of the scores not listed."""
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + c * chunk
    win = tl.full([BLOCK], NEG_INF, tl.float32)       # per position: the largest s, its id ...
    win_id = c * chunk + tl.arange(0, BLOCK)          # (distinct per position, also while s is -inf)
    run = tl.full([BLOCK], NEG_INF, tl.float32)       # ... the runner-up, its id ...
    run_id = win_id
    third = tl.full([BLOCK], NEG_INF, tl.float32)     # ... and the largest of the others
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        x = _raw(x_row, idx, vocab)
        best, arg = _track_max(x, idx, best, arg)
        s = x * inv_t
        above = s > win                               # ">": the first of equal scores stays ahead
        second = (s > run) & ~above
        third = tl.maximum(third, tl.where(above | second, run, s))
        run_id = tl.where(above, win_id, tl.where(second, idx, run_id))
        run = tl.where(above, win, tl.where(second, s, run))
        win_id = tl.where(above, idx, win_id)
        win = tl.where(above, s, win)
    m, first = _max_and_first(best, arg)
    tl.store(row_part, m)
    # One int64 per entry, the score's order-preserving key above INT_MAX - id (larger: a larger score
    # or, among equal ones, a lower id; distinct per entry), and four entries a block-wide reduction.
    k_win = (_key(win).to(tl.int64) << 32) | (2**31 - 1 - win_id.to(tl.int64))
    k_run = (_key(run).to(tl.int64) << 32) | (2**31 - 1 - run_id.to(tl.int64))
    none = tl.full([BLOCK], K_NEG_INF, tl.int64)
    for i in tl.static_range(0, TK, 4):
        t0, t1, t2, t3 = tl.reduce((k_win, k_run, none, none), 0, _top4)
        _store_entry(values, ids, i, t0)
        _store_entry(values, ids, i + 1, t1)
        _store_entry(values, ids, i + 2, t2)
        _store_entry(values, ids, i + 3, t3)
        hit_win = (k_win == t0) | (k_win == t1) | (k_win == t2) | (k_win == t3)
        hit_run = (k_run == t0) | (k_run == t1) | (k_run == t2) | (k_run == t3)
        k_win = tl.where(hit_win, tl.where(hit_run, K_NEG_INF, k_run), k_win)   # the runner-up moves up;
        k_run = tl.where(hit_win | hit_run, K_NEG_INF, k_run)                      # what is below stays bounded
    left = _unkey((tl.max(k_win, 0) >> 32).to(tl.int32))
    tl.store(bound, tl.maximum(left, tl.max(third, 0)))
    return first


@triton.jit
def _list_topk(x_row, values_ptr, bound_ptr, part_f_ptr, part_i_ptr, cand_ptr, zrow, row, c, chunk, num_chunks,
               vocab, inv_t, top_k, cand_block, BLOCK: tl.constexpr, TK: tl.constexpr, C_PAD: tl.constexpr):
    """Level-1 work of a top-k row: a complete one is marked for the select pass (zones STATE
    COMPLETE); otherwise each program lists its chunk's tokens with ``s >= L`` into its ``cand``
    segment (the select pass's list, nothing surely kept above it) and the row's last program
    checks the list fits."""
    e = tl.arange(0, C_PAD * TK)
    vals = tl.load(values_ptr + row * num_chunks * TK + e, mask=e < num_chunks * TK, other=NEG_INF)
    cs = tl.arange(0, C_PAD)
    bound = tl.max(tl.load(bound_ptr + row * num_chunks + cs, mask=cs < num_chunks, other=NEG_INF), 0)
    if tl.sum((vals > bound).to(tl.int32), 0) >= top_k:              # complete: L = v_k > every unlisted score
        if c == 0:
            tl.store(zrow + STATE, COMPLETE)
    else:
        listed = tl.sort(vals, descending=True)
        floor_v = tl.max(tl.where(e == top_k - 1, listed, NEG_INF), 0)    # L: the k-th largest listed value
        slot = row * num_chunks + c
        n = 0
        for off in range(0, chunk, BLOCK):
            idx = c * chunk + off + tl.arange(0, BLOCK)
            s = _scaled(x_row, idx, vocab, inv_t)
            keep = (s >= floor_v) & (s > NEG_INF)
            n_blk = tl.sum(keep.to(tl.int32), 0)
            if n_blk > 0:
                dst = n + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(cand_ptr + slot * chunk + dst, idx, mask=keep)
                n += n_blk
        tl.store(part_f_ptr + slot * 4 + 2, 0.0)               # no surely-kept mass ...
        tl.store(part_f_ptr + slot * 4 + 3, NEG_INF)           # ... nor winner above the list
        tl.store(part_i_ptr + slot * 3 + 1, INT_MAX)
        tl.store(part_i_ptr + slot * 3 + 2, n)
        if tl.atomic_add(zrow + 7, 1) == num_chunks - 1:      # acq_rel: the others' counts are in
            total = tl.sum(tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 2, mask=cs < num_chunks, other=0,
                                   cache_modifier=".cg"), 0)
            tl.store(zrow + STATE, tl.where(total <= cand_block, LISTED, 2))
            tl.store(zrow + 7, 0)
