"""The sampling kernel's path for rows with a small top-k (with or without top-p and min-p): a list
of the few tokens that can be kept, instead of the histograms (see ``kernels/sampling.py``).

Every kept token lies in the top-k set ``{s >= v_k}``. The scan pass lists, per chunk, ``TOP_VALUES``
of its largest values ``s`` (a position's best and runner-up in turn: any subset of the row's values
serves). The k-th largest listed value ``L`` is at most ``v_k`` (the k-th largest of a subset is at
most the k-th largest of the whole), so ``{s >= L}`` holds the whole top-k set, usually little
more than k tokens. The level-1 launch writes their ids to the candidate list the select pass reads
(``cand``, one segment a chunk), and the select pass finds ``v_k``, ``Z_k``, ``v_p`` and the
Gumbel winner over them exactly, as it does for the histogram path's undecided zone (with nothing
surely kept above it). A list of at most ``CB_SORT`` tokens (a top-k of 50 lists 50-66) is done
there and then instead: the row's last level-1 program sorts it as the select pass would
(``sampling_select._sorted``) and the row is decided, a launch earlier. A row with more than
``cand_block`` such tokens (a wide tie at ``L``; or ``k`` above the listed count, where
``L = -inf``) falls back to the histogram path from the level-2 launch, as the chain's rows do.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sampling_chain import STATE, TOKEN
from .sampling_common import INT_MAX, NEG_INF, THRESHOLDS, _finite_or_neg_inf, _max_and_first, _raw, _track_max
from .sampling_select import CB_SORT, _sorted

TOP_VALUES = 8   # values a chunk lists (k up to TOP_VALUES * chunks takes this path)
LISTED = tl.constexpr(3)   # zones STATE of a row whose candidates are listed (see sampling_chain.STATE)


@triton.jit
def _is_topk(t, top_k, vocab, num_chunks, TK: tl.constexpr):
    """Sampled rows with a top-k the chunks' lists can reach."""
    return (t > 0) & (top_k > 0) & (top_k < vocab) & (top_k <= num_chunks * TK)


@triton.jit
def _scan_values(x_row, row_part, values, c, chunk, vocab, inv_t, BLOCK: tl.constexpr, TK: tl.constexpr):
    """The raw max and its lowest index (as for every row), and TK of the chunk's values ``s``."""
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + c * chunk
    win = tl.full([BLOCK], NEG_INF, tl.float32)       # per position: the largest s and the runner-up
    run = tl.full([BLOCK], NEG_INF, tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        x = _raw(x_row, idx, vocab)
        best, arg = _track_max(x, idx, best, arg)
        s = x * inv_t
        run = tl.maximum(run, tl.minimum(s, win))
        win = tl.maximum(win, s)
    m, first = _max_and_first(best, arg)
    tl.store(row_part, m)
    for i in tl.static_range(TK):
        top = tl.max(win, 0)
        tl.store(values + i, top)
        hit = win == top                              # every position holding it gives its runner-up
        win = tl.where(hit, run, win)
        run = tl.where(hit, NEG_INF, run)
    return first


@triton.jit
def _list_topk(x_row, values_ptr, part_f_ptr, part_i_ptr, cand_ptr, zrow, row, c, chunk, num_chunks, vocab, inv_t,
               s_max, top_k, top_p, min_p, seed, offset, cand_block, BLOCK: tl.constexpr, TK: tl.constexpr,
               C_PAD: tl.constexpr):
    """Level-1 work of a top-k row: the chunk's tokens with ``s >= L`` into its ``cand`` segment (the
    select pass's list, nothing surely kept above it). The row's last program checks the list fits
    and, if it is short (a top-k of 50's), takes the row's token from it as the select pass would
    (``_sorted``): the row is then decided (STATE 1), and the select pass only reads the token."""
    e = tl.arange(0, C_PAD * TK)
    listed = tl.sort(tl.load(values_ptr + row * num_chunks * TK + e, mask=e < num_chunks * TK, other=NEG_INF),
                     descending=True)
    floor_v = tl.max(tl.where(e == top_k - 1, listed, NEG_INF), 0)    # L: the k-th largest listed value
    slot = row * num_chunks + c
    n = 0
    # the next block is loaded ahead, so that its load overlaps this block's count (a block-wide
    # reduction: a barrier every step)
    end = tl.minimum(vocab, (c + 1) * chunk)
    nxt = tl.load(x_row + c * chunk + tl.arange(0, BLOCK), mask=c * chunk + tl.arange(0, BLOCK) < end, other=NEG_INF)
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
    if tl.atomic_add(zrow + 7, 1) == num_chunks - 1:      # acq_rel: the others' counts and lists are in
        cs = tl.arange(0, C_PAD)
        counts = tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 2, mask=cs < num_chunks, other=0,
                         cache_modifier=".cg")
        total = tl.sum(counts, 0)
        state = tl.where(total <= cand_block, LISTED, 2)
        if (total <= CB_SORT) & (total <= cand_block):
            zero_f = tl.zeros([], tl.float32)         # Z, tokens and mass above the list: none
            v_k, v_p, m, m_id = _sorted(x_row, tl.cumsum(counts, 0), cand_ptr, row, num_chunks, chunk, vocab, inv_t,
                                        s_max, zero_f, zero_f.to(tl.int32), zero_f, top_k, top_p, min_p, seed,
                                        offset, CB_SORT)
            if m > NEG_INF:                              # (the row's max is listed and kept: always)
                tl.store(zrow + TOKEN, m_id)
                tl.store(zrow + THRESHOLDS, v_k.to(tl.int32, bitcast=True))
                tl.store(zrow + THRESHOLDS + 1, v_p.to(tl.int32, bitcast=True))
                state = 1
        tl.store(zrow + STATE, state)
        tl.store(zrow + 7, 0)
