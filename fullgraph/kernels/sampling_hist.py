"""Passes 2-4 of the sampling kernel (``kernels.sampling``): the level-1 launch (the chain's check,
the top-k list, the histogram path's first histogram and zones) and the tail launch (level 2, then
the compacting pass, with a barrier of a row's programs between them where the row has level-2
work). See ``kernels/sampling.py`` for the algorithm."""
from __future__ import annotations

import triton
import triton.language as tl

from . import compile_ahead, pdl
from .sampling_chain import STATE, _check_chain, _is_chain
from .sampling_common import (INT_MAX, NEG_INF, ZONES_W, _bucket, _min_p_bucket, _noise_block, _position, _row_max,
                              _row_sum, _scaled, _zones)
from .sampling_topk import LISTED, _is_topk, _list_topk


@triton.jit
def _level_zones(hist_row, zrow, part_f_ptr, row, num_chunks, top_k, top_p, min_p, vocab, refine_above,
                 LEVEL: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr, C_PAD: tl.constexpr):
    """Run by the row's last histogram program: zones row = b_hi1, b_lo1, sub, b_hi, b_lo, n_hi, n_mid."""
    b = tl.arange(0, NB)
    z = _row_sum(part_f_ptr, row, num_chunks, 1, 4, C_PAD)
    cnt = tl.load(hist_row + b, cache_modifier=".cg")
    if LEVEL == 1:
        b_hi, b_lo, n_hi, n_mid = _zones(cnt, z, top_k, top_p, min_p, vocab, 0, 0.0, 0.0, BPN, True, NB)
        span = b_lo - b_hi + 1
        sub = 0
        if (n_mid > refine_above) & (b_lo < NB - 1) & (span > 0) & (2 * span <= NB - 1):
            sub = 2
            while 2 * sub * span <= NB - 1:
                sub *= 2
            tl.store(hist_row + b, tl.zeros([NB], tl.int32))         # level 2 counts into it
        tl.store(zrow + 0, b_hi)
        tl.store(zrow + 1, b_lo)
        tl.store(zrow + 2, sub)
    else:
        m_above = _row_sum(part_f_ptr, row, num_chunks, 2, 4, C_PAD)
        b_hi1, sub = tl.load(zrow), tl.load(zrow + 2)
        b_hi, b_lo, n_hi, n_mid = _zones(tl.where(b < NB - 1, cnt, 0), z, top_k, top_p, min_p, vocab,
                                         tl.load(zrow + 5), m_above, b_hi1.to(tl.float32) / BPN,
                                         (BPN * sub).to(tl.float32), False, NB)
    tl.store(zrow + 3, b_hi)
    tl.store(zrow + 4, b_lo)
    tl.store(zrow + 5, n_hi)
    tl.store(zrow + 6, n_mid)


@compile_ahead.kernel
@triton.jit
def _hist_kernel(
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr, hist_ptr, zones_ptr,
        list_f_ptr, list_i_ptr, chain_f_ptr, values_ptr, part_i_ptr, cand_ptr,
        vocab, chunk, num_chunks, refine_above, cand_block,                                      # sizes
        stride_l,                                                                                # strides
        NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr,
        T: tl.constexpr, J: tl.constexpr, TK: tl.constexpr, USE_PDL: tl.constexpr):
    """Pass 2: level 1 (the chain's check, the top-k list, the histogram path's first histogram)."""
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    _hist_phase(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr, hist_ptr,
                zones_ptr, list_f_ptr, list_i_ptr, chain_f_ptr, values_ptr, part_i_ptr, cand_ptr,
                tl.program_id(0).to(tl.int64), tl.program_id(1), vocab, chunk, num_chunks, refine_above, cand_block,
                stride_l, NB, BPN, BLOCK, C_PAD, 1, T, J, TK)


@triton.jit
def _hist_phase(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr, hist_ptr,
                zones_ptr, list_f_ptr, list_i_ptr, chain_f_ptr, values_ptr, part_i_ptr, cand_ptr, row, c, vocab, chunk,
                num_chunks, refine_above, cand_block, stride_l, NB: tl.constexpr, BPN: tl.constexpr,
                BLOCK: tl.constexpr, C_PAD: tl.constexpr, LEVEL: tl.constexpr, T: tl.constexpr, J: tl.constexpr,
                TK: tl.constexpr):
    """Program (row, c)'s share of a histogram level; returns whether the row had histogram work
    (the same in every program of the row)."""
    t, top_k, top_p, min_p = tl.load(temp_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), \
        tl.load(min_p_ptr + row)
    zrow = zones_ptr + row * ZONES_W
    chain = _is_chain(t, top_k, min_p, vocab)
    topk = _is_topk(t, top_k, vocab, num_chunks, TK)
    filtered = (t > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    # what this program has to do, known before the row's max is read (most programs of a step
    # whose rows all take the chain or the top-k list have nothing to do at level 2)
    if LEVEL == 1:
        busy = tl.where(chain, (top_p < 1.0) | (c == 0), filtered)
    else:
        busy = tl.where(chain | topk, tl.load(zrow + STATE) == 2, filtered & (tl.load(zrow + 2) > 0))
    go = False
    first = LEVEL == 1                               # level-1 work: a histogram of the whole row
    b_hi1, b_lo1, sub = 0, 0, 0
    x_row = logits_ptr + row * stride_l
    inv_t = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
    s_max = tl.full([], NEG_INF, tl.float32)
    if busy:
        s_max = _row_max(part_f_ptr, row, num_chunks, C_PAD) * inv_t
        go = filtered & (s_max > NEG_INF)
        if LEVEL == 1:
            if chain & (s_max > NEG_INF):
                _check_chain(x_row, chain_f_ptr, list_f_ptr, list_i_ptr, zrow, s_max, row, c, chunk, num_chunks,
                             vocab, inv_t, top_p, BLOCK, J, T, C_PAD)
            if topk & (s_max > NEG_INF):
                _list_topk(x_row, values_ptr, part_f_ptr, part_i_ptr, cand_ptr, zrow, row, c, chunk, num_chunks,
                           vocab, inv_t, s_max, top_k, top_p, min_p, tl.load(seed_ptr + row), tl.load(offset_ptr + row),
                           cand_block, BLOCK, TK, C_PAD)
            go = go & ~chain & ~topk
        else:                                        # rows whose level-1 zone was too wide, and chain
            first = chain | topk                     # or top-k rows that fell back (their level 1 runs here)
            b_hi1, b_lo1, sub = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2)
            b_hi1, b_lo1, sub = tl.where(first, 0, b_hi1), tl.where(first, 0, b_lo1), tl.where(first, 0, sub)
    if go:
        acc = tl.zeros([BLOCK], tl.float32)         # Z (level 1), exact mass above the zone (level 2), per lane
        hist = tl.zeros([NB], tl.int32)
        for off in range(0, chunk, BLOCK):
            s = _scaled(x_row, c * chunk + off + tl.arange(0, BLOCK), vocab, inv_t)
            e = tl.exp(s - s_max)
            if LEVEL == 1:
                acc += e
                pos = _bucket(s, s_max, NB, BPN)
            else:                                    # sub == 0: _position is the level-1 bucket
                pos = _position(s, s_max, b_hi1, b_lo1, sub, NB, BPN)
                acc += tl.where(first, e, tl.where(pos < 0, e, 0.0))
                pos = tl.where(first, pos, tl.where((pos >= 0) & (pos < NB - 1), pos, NB - 1))
            hist += tl.histogram(pos, NB)
        tl.atomic_add(hist_ptr + row * NB + tl.arange(0, NB), hist, mask=hist > 0, sem="relaxed")
        tl.store(part_f_ptr + (row * num_chunks + c) * 4 + tl.where(first, 1, 2), tl.sum(acc, 0))
        if tl.atomic_add(zrow + 7, 1) == num_chunks - 1:          # acq_rel: the others' counts are in
            if first:                                # level 2 has no launch left for a fallen-back row
                _level_zones(hist_ptr + row * NB, zrow, part_f_ptr, row, num_chunks, top_k, top_p, min_p, vocab,
                             tl.where(LEVEL == 1, refine_above, INT_MAX), 1, NB, BPN, C_PAD)
            else:
                _level_zones(hist_ptr + row * NB, zrow, part_f_ptr, row, num_chunks, top_k, top_p, min_p, vocab,
                             refine_above, 2, NB, BPN, C_PAD)
            tl.store(zrow + 7, 0)
    return go


BARRIER = tl.constexpr(12)   # zones column: the tail launch's arrivals at its per-row barrier


@triton.jit
def _row_barrier(counter, num_chunks):
    """Wait until every program of the row has arrived: a generation barrier (the count only grows;
    the scan pass zeroes it every call), so a replay of the launch alone also pairs up. Every
    program of the row must be resident at once: the tail's grid is (chunk, row), rows in launch
    order, and a row's programs are far fewer than an SM count's worth of programs."""
    tl.debug_barrier()                               # the program's writes (every thread's) before it arrives
    n = tl.atomic_add(counter, 1, sem="acq_rel") + 1
    target = ((n - 1) // num_chunks + 1) * num_chunks
    while n < target:
        n = tl.atomic_add(counter, 0, sem="acquire")


@compile_ahead.kernel
@triton.jit
def _tail_kernel(
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr,   # pointers
        part_f_ptr, part_i_ptr, hist_ptr, zones_ptr, list_f_ptr, list_i_ptr, chain_f_ptr, values_ptr, cand_ptr,
        vocab, chunk, num_chunks, refine_above, cand_block,                            # sizes
        stride_l,                                                                      # strides
        NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr, T: tl.constexpr,
        J: tl.constexpr, TK: tl.constexpr, PHASE: tl.constexpr, USE_PDL: tl.constexpr):
    """Passes 3 and 4 in one launch (PHASE 0): level 2, then, in rows that had level-2 work, a
    barrier of the row's programs, then the compacting pass. Rows that need neither (the chain's
    and the top-k list's, greedy ones) leave at once: one launch with nothing to do where there
    were two. PHASE 2 or 3 runs one of them alone (two launches: the interpreter runs one program
    after another, so no program may wait for another)."""
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if PHASE != 3:
        go = _hist_phase(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr,
                         hist_ptr, zones_ptr, list_f_ptr, list_i_ptr, chain_f_ptr, values_ptr, part_i_ptr, cand_ptr,
                         row, c, vocab, chunk, num_chunks, refine_above, cand_block, stride_l, NB, BPN, BLOCK, C_PAD, 2,
                         T, J, TK)
        if PHASE == 0:
            if go:                                   # the row's zones, from its last program, before compacting
                _row_barrier(zones_ptr + row * ZONES_W + BARRIER, num_chunks)
    if PHASE != 2:
        _compact_phase(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr,
                       part_i_ptr, zones_ptr, cand_ptr, row, c, vocab, chunk, num_chunks, chunk, stride_l, NB, BPN,
                       BLOCK, C_PAD)


@triton.jit
def _compact_phase(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr,
                   part_i_ptr, zones_ptr, cand_ptr, row, c, vocab, chunk, num_chunks, seg_cap, stride_l,
                   NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr):
    """Program (row, c)'s share of the compacting pass. The zones may come from this launch's level
    2 (another program's writes, after the row's barrier): read from L2 (``.cg``)."""
    t, top_k, top_p = tl.load(temp_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    inv_t = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
    zrow = zones_ptr + row * ZONES_W
    s_max = tl.full([], NEG_INF, tl.float32)
    state = tl.load(zrow + STATE, cache_modifier=".cg")
    if (t > 0) & (state != 1) & (state != LISTED):     # not decided by the chain, nor listed for top-k
        s_max = _row_max(part_f_ptr, row, num_chunks, C_PAD) * inv_t
    if s_max > NEG_INF:
        min_p, seed, offset = tl.load(min_p_ptr + row), tl.load(seed_ptr + row), tl.load(offset_ptr + row)
        zero = tl.zeros([], tl.int32)                               # no top-k / top-p: min-p alone
        b_hi1, b_lo1, sub, b_hi, b_lo = zero, zero, zero, zero + NB, _min_p_bucket(min_p, 0.0, BPN, NB)
        if ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0):
            b_hi1, b_lo1, sub = tl.load(zrow, cache_modifier=".cg"), tl.load(zrow + 1, cache_modifier=".cg"), \
                tl.load(zrow + 2, cache_modifier=".cg")
            b_hi, b_lo = tl.load(zrow + 3, cache_modifier=".cg"), tl.load(zrow + 4, cache_modifier=".cg")
        # reduced a step at a time: per-lane accumulators here took the kernel from 82 to 114
        # registers a thread (sm_90, 1024-token steps; 127 -> 229 at 4096), fewer programs an SM
        mass_hi = tl.zeros([], tl.float32)
        best = tl.full([], NEG_INF, tl.float32)
        best_id = c * chunk
        n = 0
        for off in range(0, chunk, BLOCK):
            start = c * chunk + off
            idx = start + tl.arange(0, BLOCK)
            s = _scaled(logits_ptr + row * stride_l, idx, vocab, inv_t)
            pos = _position(s, s_max, b_hi1, b_lo1, sub, NB, BPN)
            e = tl.exp(s - s_max)
            mass_hi += tl.sum(tl.where(pos < b_hi, e, 0.0), 0)
            keep = (pos < b_hi) & (pos <= b_lo) & (s > NEG_INF) & (e >= min_p)
            if tl.max(keep.to(tl.int32), 0) > 0:
                score = tl.where(keep, s + _noise_block(start, seed, offset, BLOCK), NEG_INF)
                m, at = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
                best_id = tl.where(m > best, start + at, best_id)
                best = tl.maximum(best, m)
            mid = (pos >= b_hi) & (pos <= b_lo) & (s > NEG_INF)
            n_blk = tl.sum(mid.to(tl.int32), 0)
            if n_blk > 0:
                dst = n + tl.cumsum(mid.to(tl.int32), 0) - 1
                tl.store(cand_ptr + (row * num_chunks + c) * seg_cap + dst, idx, mask=mid & (dst < seg_cap))
                n += n_blk
        tl.store(part_f_ptr + (row * num_chunks + c) * 4 + 2, mass_hi)
        tl.store(part_f_ptr + (row * num_chunks + c) * 4 + 3, best)
        tl.store(part_i_ptr + (row * num_chunks + c) * 3 + 1, best_id)
        tl.store(part_i_ptr + (row * num_chunks + c) * 3 + 2, n)
