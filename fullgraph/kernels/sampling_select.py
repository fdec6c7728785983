"""Pass 5 of the sampling kernel (``kernels.sampling``): exact top-k / top-p thresholds over each
row's undecided tokens and the Gumbel winner among the kept ones. See ``kernels/sampling.py``."""
from __future__ import annotations

import triton
import triton.language as tl

from . import compile_ahead, pdl
from .sampling_chain import STATE, TOKEN
from .sampling_common import (INT_MAX, NEG_INF, THRESHOLDS, ZONES_W, _key, _noise_at, _position, _row_max, _row_sum,
                              _scaled, _unkey)

CB_SORT = tl.constexpr(128)   # undecided lists this short are sorted instead of searched

@triton.jit
def _stat(sv, e, tv, BY_MASS: tl.constexpr):
    """(P,) count (or mass) of ``sv >= tv[p]``; sv is -inf off the undecided set."""
    sel = sv[:, None] >= tv[None, :]
    if BY_MASS:
        stat = tl.sum(tl.where(sel, e[:, None], 0.0), 0)
    else:
        stat = tl.sum(sel.to(tl.int32), 0)
    return stat


@triton.jit
def _row_stat(x_row, vocab, inv_t, s_max, zrow, tv, BY_MASS: tl.constexpr, NB: tl.constexpr,
              BPN: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_stat` over the row's undecided zone, re-read from the logits (the slow path)."""
    b_hi1, b_lo1, sub, b_hi, b_lo = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2), tl.load(zrow + 3), \
        tl.load(zrow + 4)
    if BY_MASS:
        acc = tl.zeros(tv.shape, tl.float32)
    else:
        acc = tl.zeros(tv.shape, tl.int32)
    for start in range(0, vocab, BLOCK):
        s = _scaled(x_row, start + tl.arange(0, BLOCK), vocab, inv_t)
        pos = _position(s, s_max, b_hi1, b_lo1, sub, NB, BPN)
        acc += _stat(tl.where((pos >= b_hi) & (pos <= b_lo), s, NEG_INF), tl.exp(s - s_max), tv, BY_MASS)
    return acc


@triton.jit
def _search(lo, hi, floor_v, base, target, sv, e, x_row, vocab, inv_t, s_max, zrow,
            BY_MASS: tl.constexpr, FROM_ROW: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr,
            BLOCK: tl.constexpr, P: tl.constexpr):
    """Largest key in (lo, hi) with ``base + stat(max(unkey(key), floor_v)) >= target``, else lo:
    a (P+1)-way search (the statistic is monotone in the key), lo and hi never tested."""
    j = tl.arange(0, P).to(tl.int64)
    while hi - lo > 1:
        piv = tl.minimum(tl.maximum(lo + (hi - lo) * (j + 1) // (P + 1), lo + 1), hi - 1)      # (P,)
        k = piv.to(tl.int32)                               # _unkey, inlined (interpreter speed)
        tv = tl.maximum((k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), floor_v)
        if FROM_ROW:
            stat = _row_stat(x_row, vocab, inv_t, s_max, zrow, tv, BY_MASS, NB, BPN, BLOCK)
        else:
            stat = _stat(sv, e, tv, BY_MASS)
        yes = base + stat >= target
        lo, hi = tl.max(tl.where(yes, piv, lo), 0), tl.min(tl.where(yes, hi, piv), 0)
    return lo


@triton.jit
def _segment_ends(part_i_ptr, ends_ptr, row, num_chunks, C_PAD: tl.constexpr):
    """Store where each chunk's segment of the row's undecided list ends (the running sum of the
    chunks' counts) at ``ends_ptr``, for :func:`_list_ids`; visible to every thread on return."""
    cs = tl.arange(0, C_PAD)
    counts = tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 2, mask=cs < num_chunks, other=0)
    tl.store(ends_ptr + cs, tl.cumsum(counts, 0))
    tl.debug_barrier()


@triton.jit
def _list_ids(ends_ptr, cand_ptr, row, num_chunks, seg_cap, start, N: tl.constexpr, C_PAD: tl.constexpr,
              C_BITS: tl.constexpr):
    """Ids at positions start .. start + N of the row's undecided list (the chunks' segments in
    chunk order), and which positions exist. Each position finds its chunk, the number of segments
    ending at or before it, by a branchless binary search over the segment ends (:func:`_segment_ends`;
    C_PAD of them, the padding ones at the total): C_BITS = log2(C_PAD) rounds of one gather, where
    a walk over the chunks waited for one load per chunk."""
    p = start + tl.arange(0, N)
    seg = tl.zeros([N], tl.int32)
    for i in tl.static_range(C_BITS):
        step = C_PAD >> (i + 1)
        seg += tl.where(tl.load(ends_ptr + seg + (step - 1)) <= p, step, 0)
    base = tl.load(ends_ptr + seg - 1, mask=seg > 0, other=0)
    ok = p < tl.load(ends_ptr + C_PAD - 1)
    return tl.load(cand_ptr + (row * num_chunks + seg) * seg_cap + p - base, mask=ok, other=0), ok


@triton.jit
def _register_search(cid, ok, x_row, vocab, inv_t, s_max, floor_v, base, target, BY_MASS: tl.constexpr,
                     P: tl.constexpr):
    """Exact threshold over the tokens ``cid[ok]`` held in registers (-inf: all pass), and their
    mass at or above it."""
    s = _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t)
    e = tl.exp(s - s_max)
    sv = tl.where(ok, s, NEG_INF)
    keys = _key(s)
    lo = tl.min(tl.where(ok, keys, INT_MAX), 0).to(tl.int64) - 1
    hi = tl.max(tl.where(ok, keys, -INT_MAX), 0).to(tl.int64) + 1
    kk = _search(lo, hi, floor_v, base, target, sv, e, x_row, vocab, inv_t, s_max, x_row, BY_MASS, False, 1, 1, 1, P)
    v = tl.where(kk > lo, _unkey(kk.to(tl.int32)), NEG_INF)
    return v, tl.sum(tl.where(sv >= tl.maximum(v, floor_v), e, 0.0), 0)


@triton.jit
def _winner(cid, s, keep, seed, offset):
    """(score, id) of the Gumbel winner among the tokens ``cid[keep]`` of scores ``s``: the highest
    ``s + noise``, the lowest id among equal ones."""
    score = tl.where(keep, s + _noise_at(cid, seed, offset), NEG_INF)
    m = tl.max(score, 0)
    return m, tl.min(tl.where(keep & (score == m), cid, INT_MAX), 0)


@triton.jit
def _list_winner(x_row, ends_ptr, cand_ptr, row, num_chunks, seg_cap, n_list, vocab, inv_t, s_max, v_k, v_p,
                 min_p, seed, offset, LB: tl.constexpr, C_PAD: tl.constexpr, C_BITS: tl.constexpr):
    """(score, id) of the Gumbel winner among the listed tokens passing v_k, v_p and min-p."""
    best, best_id = tl.full([], NEG_INF, tl.float32), INT_MAX
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(ends_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB, C_PAD, C_BITS)
        s = _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t)
        keep = ok & (s > NEG_INF) & (s >= v_k) & (s >= v_p) & (tl.exp(s - s_max) >= min_p)
        m, m_id = _winner(cid, s, keep, seed, offset)
        best_id = tl.where((m > best) | ((m == best) & (m_id < best_id)), m_id, best_id)
        best = tl.maximum(best, m)
    return best, best_id


@triton.jit
def _bucket_search(x_row, ends_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list, vocab,
                   inv_t, s_max, bucket, floor_v, base, target, BY_MASS: tl.constexpr, CB: tl.constexpr,
                   LB: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr, C_PAD: tl.constexpr,
                   C_BITS: tl.constexpr):
    """:func:`_register_search` over the listed tokens at one position, packed into ``scratch_row``
    first; also returns how many there were (the result is valid only if <= CB)."""
    b_hi1, b_lo1, sub = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2)
    n = 0
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(ends_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB, C_PAD, C_BITS)
        s = _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t)
        sel = ok & (_position(s, s_max, b_hi1, b_lo1, sub, NB, BPN) == bucket)
        pos = n + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(scratch_row + pos, cid, mask=sel & (pos < CB))
        n += tl.sum(sel.to(tl.int32), 0)
    tl.debug_barrier()                                   # the packed ids, visible to every thread
    p = tl.arange(0, CB)
    cid = tl.load(scratch_row + p, mask=p < n, other=0)
    v, mass = _register_search(cid, p < n, x_row, vocab, inv_t, s_max, floor_v, base, target, BY_MASS, 2)
    return v, mass, n


@triton.jit
def _refined_thresholds(x_row, ends_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list, vocab,
                        inv_t, s_max, z, n_hi, mass_hi, top_k, top_p, CB: tl.constexpr, RB: tl.constexpr,
                        LB: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr, C_PAD: tl.constexpr,
                        C_BITS: tl.constexpr):
    """(v_k, v_p, failed) for a large undecided list: exact counts and masses of its positions
    b_hi .. b_hi + RB - 1 pin each threshold to one position, searched in registers."""
    b_hi1, b_lo1, sub, b_hi = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2), tl.load(zrow + 3)
    r = tl.arange(0, RB)
    cnt, mass = tl.zeros([RB], tl.int32), tl.zeros([RB], tl.float32)
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(ends_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB, C_PAD, C_BITS)
        s = _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t)
        rel = _position(s, s_max, b_hi1, b_lo1, sub, NB, BPN) - b_hi
        hit = ok[:, None] & (rel[:, None] == r[None, :])                                     # (LB, RB)
        cnt += tl.sum(hit.to(tl.int32), 0)
        mass += tl.sum(tl.where(hit, tl.exp(s - s_max)[:, None], 0.0), 0)
    fail = False
    v_k = tl.full([], NEG_INF, tl.float32)
    r_k = RB
    if (top_k > 0) & (top_k < vocab):
        r_k = tl.sum((n_hi + tl.cumsum(cnt, 0) < top_k).to(tl.int32), 0)                   # its bucket
        v_k, m_k, n = _bucket_search(x_row, ends_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list,
                                     vocab, inv_t, s_max, b_hi + r_k, v_k, n_hi + tl.sum(tl.where(r < r_k, cnt, 0), 0),
                                     top_k, False, CB, LB, NB, BPN, C_PAD, C_BITS)
        fail = (r_k >= RB) | (n > CB)
        z = mass_hi + tl.sum(tl.where(r < r_k, mass, 0.0), 0) + m_k
    v_p = tl.full([], NEG_INF, tl.float32)
    if top_p < 1.0:
        q = top_p * z
        r_p = tl.minimum(tl.sum((mass_hi + tl.cumsum(mass, 0) < q).to(tl.int32), 0), r_k)
        v_p, _, n = _bucket_search(x_row, ends_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list,
                                   vocab, inv_t, s_max, b_hi + r_p, v_k, mass_hi + tl.sum(tl.where(r < r_p, mass, 0.0), 0),
                                   q, True, CB, LB, NB, BPN, C_PAD, C_BITS)
        fail = fail | (r_p >= RB) | (n > CB)
    return v_k, v_p, fail


@triton.jit
def _row_thresholds(x_row, zrow, vocab, inv_t, s_max, z, n_hi, mass_hi, top_k, top_p, NB: tl.constexpr,
                    BPN: tl.constexpr, BLOCK: tl.constexpr):
    """(v_k, v_p) searched over the whole row's undecided zone, re-read at every step (slow, exact)."""
    lo = _key(tl.full([], NEG_INF, tl.float32)).to(tl.int64)
    hi = _key(s_max).to(tl.int64) + 1
    one = tl.zeros([1], tl.float32)
    v_k = tl.full([], NEG_INF, tl.float32)
    if (top_k > 0) & (top_k < vocab):
        kk = _search(lo, hi, v_k, n_hi, top_k, one, one, x_row, vocab, inv_t, s_max, zrow, False, True,
                     NB, BPN, BLOCK, 8)
        v_k = tl.where(kk > lo, _unkey(kk.to(tl.int32)), NEG_INF)
        z = mass_hi + tl.sum(_row_stat(x_row, vocab, inv_t, s_max, zrow, one + v_k, True, NB, BPN, BLOCK), 0)
    v_p = tl.full([], NEG_INF, tl.float32)
    if top_p < 1.0:
        pk = _search(lo, hi, v_k, mass_hi, top_p * z, one, one, x_row, vocab, inv_t, s_max, zrow, True, True,
                     NB, BPN, BLOCK, 8)
        v_p = tl.where(pk > lo, _unkey(pk.to(tl.int32)), NEG_INF)
    return v_k, v_p


@triton.jit
def _small_list_ids(ends, cand_ptr, row, num_chunks, seg_cap, N: tl.constexpr):
    """:func:`_list_ids` for positions 0 .. N - 1 with the segment ends held in registers
    (``tl.cumsum`` of the chunks' counts; padding ones at the total): each position's chunk and
    segment start from one (N, C_PAD) comparison, so the ids take one gather, where the binary
    search waited on a store, a barrier and C_BITS dependent loads."""
    p = tl.arange(0, N)
    before = ends[None, :] <= p[:, None]                       # (N, C_PAD): segments ending at or before p
    seg = tl.sum(before.to(tl.int32), 1)
    base = tl.max(tl.where(before, ends[None, :], 0), 1)
    ok = p < tl.max(ends, 0)          # (.cg: the level-1 launch's last program reads its siblings' lists)
    return tl.load(cand_ptr + (row * num_chunks + seg) * seg_cap + p - base, mask=ok, other=0,
                   cache_modifier=".cg"), ok


@triton.jit
def _sorted(x_row, ends, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t, s_max, z, n_hi, mass_hi, top_k, top_p,
            min_p, seed, offset, N: tl.constexpr):
    """(v_k, v_p, score, id) for a list of at most N tokens, held in registers, by one sort instead
    of two key searches: the scores in descending order (an int64 of the order-preserving key and
    the lane), v_k the (k - n_hi)-th of them, v_p the first at which the running mass above the list
    plus the sorted masses down to it reach ``top_p * Z_k``; then the Gumbel winner among the listed
    tokens they and min-p keep (as :func:`_list_winner`, over the same registers)."""
    cid, ok = _small_list_ids(ends, cand_ptr, row, num_chunks, seg_cap, N)
    s = tl.where(ok, _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t), NEG_INF)
    e = tl.exp(s - s_max)
    i = tl.arange(0, N)
    order = tl.sort((_key(s).to(tl.int64) << 32) | i.to(tl.int64), descending=True)
    ss = _unkey((order >> 32).to(tl.int32))                 # the scores, largest first
    v_k = tl.full([], NEG_INF, tl.float32)
    if (top_k > 0) & (top_k < vocab):
        v_k = tl.max(tl.where(i == top_k - n_hi - 1, ss, NEG_INF), 0)
        z = mass_hi + tl.sum(tl.where(s >= v_k, e, 0.0), 0)
    v_p = tl.full([], NEG_INF, tl.float32)
    if top_p < 1.0:
        above = mass_hi + tl.cumsum(tl.where(ss >= v_k, tl.exp(ss - s_max), 0.0), 0)
        at = tl.sum((above < top_p * z).to(tl.int32), 0)  # the first position whose running mass reaches the cut
        v_p = tl.max(tl.where(i == at, ss, NEG_INF), 0)
    m, m_id = _winner(cid, s, ok & (s > NEG_INF) & (s >= v_k) & (s >= v_p) & (e >= min_p), seed, offset)
    return v_k, v_p, m, m_id


@triton.jit
def _direct_thresholds(x_row, ends_ptr, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t, s_max, z, n_hi,
                       mass_hi, top_k, top_p, CB: tl.constexpr, P: tl.constexpr, C_PAD: tl.constexpr,
                       C_BITS: tl.constexpr):
    """(v_k, v_p) with the whole undecided list (<= CB tokens) in registers."""
    cid, ok = _list_ids(ends_ptr, cand_ptr, row, num_chunks, seg_cap, 0, CB, C_PAD, C_BITS)
    v_k = tl.full([], NEG_INF, tl.float32)
    if (top_k > 0) & (top_k < vocab):
        v_k, m_k = _register_search(cid, ok, x_row, vocab, inv_t, s_max, v_k, n_hi, top_k, False, P)
        z = mass_hi + m_k
    v_p = tl.full([], NEG_INF, tl.float32)
    if top_p < 1.0:
        v_p, _ = _register_search(cid, ok, x_row, vocab, inv_t, s_max, v_k, mass_hi, top_p * z, True, P)
    return v_k, v_p


@compile_ahead.kernel
@triton.jit
def _select_kernel(
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr,   # pointers
        part_f_ptr, part_i_ptr, zones_ptr, cand_ptr, scratch_ptr, out_ptr,
        vocab, num_chunks, seg_cap,                                                    # sizes
        stride_l,                                                                      # strides
        NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr,
        CB: tl.constexpr, CB_SMALL: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, C_BITS: tl.constexpr,
        USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    zrow = zones_ptr + row * ZONES_W
    token = tl.load(zrow + TOKEN)                                  # the chain's, if it decided the row
    if tl.load(zrow + STATE) != 1:
        token = _unchained(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr,
                           part_i_ptr, cand_ptr, scratch_ptr, zrow, row, vocab, num_chunks, seg_cap, stride_l,
                           NB, BPN, BLOCK, C_PAD, CB, CB_SMALL, RB, LB, C_BITS)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _unchained(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, part_f_ptr, part_i_ptr,
               cand_ptr, scratch_ptr, zrow, row, vocab, num_chunks, seg_cap, stride_l, NB: tl.constexpr,
               BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr, CB: tl.constexpr, CB_SMALL: tl.constexpr,
               RB: tl.constexpr, LB: tl.constexpr, C_BITS: tl.constexpr):
    """The token of a row the chain did not decide: greedy, or the winner over its exact thresholds."""
    cs = tl.arange(0, C_PAD)
    x_max = _row_max(part_f_ptr, row, num_chunks, C_PAD)
    args = tl.load(part_i_ptr + (row * num_chunks + cs) * 3, mask=cs < num_chunks, other=INT_MAX)
    maxes = tl.load(part_f_ptr + (row * num_chunks + cs) * 4, mask=cs < num_chunks, other=NEG_INF)
    token = tl.min(tl.where(maxes == x_max, args, INT_MAX), 0)                 # greedy: lowest argmax
    t = tl.load(temp_ptr + row)
    inv_t = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
    s_max = x_max * inv_t
    if (t > 0) & (s_max > NEG_INF):
        top_k, top_p, min_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
        seed, offset = tl.load(seed_ptr + row), tl.load(offset_ptr + row)
        z = _row_sum(part_f_ptr, row, num_chunks, 1, 4, C_PAD)
        mass_hi = _row_sum(part_f_ptr, row, num_chunks, 2, 4, C_PAD)
        n_list = _row_sum(part_i_ptr, row, num_chunks, 2, 3, C_PAD)
        scores = tl.load(part_f_ptr + (row * num_chunks + cs) * 4 + 3, mask=cs < num_chunks, other=NEG_INF)
        ids = tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 1, mask=cs < num_chunks, other=INT_MAX)
        best = tl.max(scores, 0)                                   # the surely-kept zone's winner
        best_id = tl.min(tl.where(scores == best, ids, INT_MAX), 0)
        n_hi = tl.load(zrow + 5)
        x_row = logits_ptr + row * stride_l
        if (n_list > 0) & (n_list <= CB_SORT):                  # a short list (a top-k of 50): sorted in registers
            counts = tl.load(part_i_ptr + (row * num_chunks + cs) * 3 + 2, mask=cs < num_chunks, other=0)
            v_k, v_p, m, m_id = _sorted(x_row, tl.cumsum(counts, 0), cand_ptr, row, num_chunks, seg_cap, vocab,
                                        inv_t, s_max, z, n_hi, mass_hi, top_k, top_p, min_p, seed, offset, CB_SORT)
            tl.store(zrow + THRESHOLDS, v_k.to(tl.int32, bitcast=True))       # for tests and inspection
            tl.store(zrow + THRESHOLDS + 1, v_p.to(tl.int32, bitcast=True))
            best_id = tl.where((m > best) | ((m == best) & (m_id < best_id)), m_id, best_id)
            best = tl.maximum(best, m)
        elif n_list > 0:
            scratch_row = scratch_ptr + row * (CB + C_PAD)
            ends = scratch_row + CB                                # the list's segment ends, after the ids
            _segment_ends(part_i_ptr, ends, row, num_chunks, C_PAD)
            if n_list <= CB_SMALL:
                v_k, v_p = _direct_thresholds(x_row, ends, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t,
                                              s_max, z, n_hi, mass_hi, top_k, top_p, CB_SMALL, 8, C_PAD, C_BITS)
            elif n_list <= CB:
                v_k, v_p = _direct_thresholds(x_row, ends, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t,
                                              s_max, z, n_hi, mass_hi, top_k, top_p, CB, 2, C_PAD, C_BITS)
            else:
                v_k, v_p, fail = _refined_thresholds(x_row, ends, cand_ptr, scratch_row, zrow, row, num_chunks,
                                                     seg_cap, n_list, vocab, inv_t, s_max, z, n_hi, mass_hi, top_k,
                                                     top_p, CB, RB, LB, NB, BPN, C_PAD, C_BITS)
                if fail:
                    v_k, v_p = _row_thresholds(x_row, zrow, vocab, inv_t, s_max, z, n_hi, mass_hi, top_k, top_p,
                                               NB, BPN, BLOCK)
            tl.store(zrow + THRESHOLDS, v_k.to(tl.int32, bitcast=True))       # for tests and inspection
            tl.store(zrow + THRESHOLDS + 1, v_p.to(tl.int32, bitcast=True))
            m, m_id = _list_winner(x_row, ends, cand_ptr, row, num_chunks, seg_cap, n_list, vocab, inv_t,
                                   s_max, v_k, v_p, min_p, seed, offset, LB, C_PAD, C_BITS)
            best_id = tl.where((m > best) | ((m == best) & (m_id < best_id)), m_id, best_id)
            best = tl.maximum(best, m)
        token = tl.where(best > NEG_INF, best_id, token)
    return token
