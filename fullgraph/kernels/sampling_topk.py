"""The sampling kernel's path for rows with a small top-k (with or without top-p and min-p): a list
of the few tokens that can be kept, instead of the histograms (see ``kernels/sampling.py``).

Every kept token lies in the top-k set ``{s >= v_k}``. The scan pass lists, per chunk, ``TOP_VALUES``
of its largest values ``s`` with their ids (a position's best and runner-up in turn: any subset of
the row's tokens serves), and a bound ``B`` every unlisted token of the chunk stays at or below
(the best a position still holds, or a runner-up listed after its position's best). The k-th largest listed
value ``L`` is at most ``v_k`` (the k-th largest of a subset is at most the k-th largest of the
whole), so ``{s >= L}`` holds the whole top-k set, usually little more than k tokens. The level-1
launch writes their ids, in id order, to the candidate list the select pass reads (``cand``, one
segment a chunk): a chunk with ``B < L`` from its own list (every token at or above ``L`` is
listed), any other by reading its logits again. The select pass finds ``v_k``, ``Z_k``, ``v_p``
and the Gumbel winner over them exactly, as it does for the histogram path's undecided zone (with
nothing surely kept above it). A row with more than ``cand_block`` such tokens (a wide tie at ``L``; or
``k`` above the listed count, where ``L = -inf``) falls back to the histogram path from the
level-2 launch, as the chain's rows do.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sampling_common import INT_MAX, NEG_INF, _finite_or_neg_inf, _max_and_first, _raw, _track_max

TOP_VALUES = 8   # values a chunk lists (k up to TOP_VALUES * chunks takes this path)
LISTED = tl.constexpr(3)   # zones STATE of a row whose candidates are listed (see sampling_chain.STATE)


@triton.jit
def _is_topk(t, top_k, vocab, num_chunks, TK: tl.constexpr):
    """Sampled rows with a top-k the chunks' lists can reach."""
    return (t > 0) & (top_k > 0) & (top_k < vocab) & (top_k <= num_chunks * TK)


@triton.jit
def _scan_values(x_row, row_part, values, value_ids, c, chunk, vocab, inv_t, BLOCK: tl.constexpr, TK: tl.constexpr):
    """The raw max and its lowest index (as for every row); TK of the chunk's values ``s`` and
    their ids (``values[:TK]``, ``value_ids``), and the bound ``values[TK]`` of the others.

    A position keeps its best value and its runner-up; every value it drops is at most its
    runner-up of the moment, which only grows. So after the loop whatever a position does not hold
    is at most its runner-up, and once the listing has taken both, at most the runner-up it listed."""
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + c * chunk
    win = tl.full([BLOCK], NEG_INF, tl.float32)       # per position: the largest s and the runner-up, their ids
    win_id = tl.zeros([BLOCK], tl.int32) + INT_MAX
    run = tl.full([BLOCK], NEG_INF, tl.float32)
    run_id = tl.zeros([BLOCK], tl.int32) + INT_MAX
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        x = _raw(x_row, idx, vocab)
        best, arg = _track_max(x, idx, best, arg)
        s = x * inv_t
        top = s > win                                 # a new best (a position's ids grow: ties keep the first)
        cand = tl.where(top, win, s)                  # the runner-up's contender: the old best, or s
        up = cand > run
        run, run_id = tl.where(up, cand, run), tl.where(up, tl.where(top, win_id, idx), run_id)
        win, win_id = tl.where(top, s, win), tl.where(top, idx, win_id)
    m, first = _max_and_first(best, arg)
    tl.store(row_part, m)
    taken = tl.zeros([BLOCK], tl.int1)                # positions whose best is listed
    cap = tl.full([], NEG_INF, tl.float32)           # the largest runner-up listed after its position's best
    for i in tl.static_range(TK):                     # the best one left, the lowest id among equals
        top = tl.max(win, 0)
        top_id = tl.min(tl.where(win == top, win_id, INT_MAX), 0)
        tl.store(values + i, top)
        tl.store(value_ids + i, top_id)
        hit = win_id == top_id                        # that position moves to its runner-up
        cap = tl.where(tl.max((hit & taken).to(tl.int32), 0) > 0, tl.maximum(cap, top), cap)
        taken = taken | hit
        win, win_id = tl.where(hit, run, win), tl.where(hit, run_id, win_id)
        run, run_id = tl.where(hit, NEG_INF, run), tl.where(hit, INT_MAX, run_id)
    tl.store(values + TK, tl.maximum(tl.max(win, 0), cap))
    return first


@triton.jit
def _list_topk(x_row, values_ptr, value_ids_ptr, part_f_ptr, part_i_ptr, cand_ptr, zrow, row, c, chunk, num_chunks,
               vocab, inv_t, top_k, cand_block, BLOCK: tl.constexpr, TK: tl.constexpr, C_PAD: tl.constexpr):
    """Level-1 work of a top-k row: the chunk's tokens with ``s >= L`` into its ``cand`` segment (the
    select pass's list, nothing surely kept above it); the row's last program checks the list fits."""
    e = tl.arange(0, C_PAD * TK)
    row_v = values_ptr + row * num_chunks * (TK + 1)
    listed = tl.sort(tl.load(row_v + (e // TK) * (TK + 1) + e % TK, mask=e < num_chunks * TK, other=NEG_INF),
                     descending=True)
    floor_v = tl.max(tl.where(e == top_k - 1, listed, NEG_INF), 0)    # L: the k-th largest listed value
    slot = row * num_chunks + c
    n = tl.full([], 0, tl.int32)
    if tl.load(values_ptr + slot * (TK + 1) + TK) < floor_v:      # B < L: the chunk's list holds them all
        i = tl.arange(0, TK)
        v = tl.load(values_ptr + slot * (TK + 1) + i)
        keep = (v >= floor_v) & (v > NEG_INF)
        n = tl.sum(keep.to(tl.int32), 0)
        tl.store(cand_ptr + slot * chunk + i, tl.sort(tl.where(keep, tl.load(value_ids_ptr + slot * TK + i), INT_MAX)),
                 mask=i < n)
    else:
        # the next block is loaded ahead, so that its load overlaps this block's count (a block-wide
        # reduction: a barrier every step)
        end = tl.minimum(vocab, (c + 1) * chunk)
        nxt = tl.load(x_row + c * chunk + tl.arange(0, BLOCK), mask=c * chunk + tl.arange(0, BLOCK) < end,
                      other=NEG_INF)
        for off in range(0, chunk, BLOCK):
            idx = c * chunk + off + tl.arange(0, BLOCK)
            s = _finite_or_neg_inf(nxt) * inv_t
            nxt = tl.load(x_row + idx + BLOCK, mask=idx + BLOCK < end, other=NEG_INF)
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
        cs = tl.arange(0, C_PAD)
        total = tl.sum(tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 2, mask=cs < num_chunks, other=0,
                               cache_modifier=".cg"), 0)
        tl.store(zrow + 8, tl.where(total <= cand_block, LISTED, 2))
        tl.store(zrow + 7, 0)
