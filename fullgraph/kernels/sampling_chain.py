"""The sampling kernel's fast path for rows filtered by top-p alone (or not at all): a chain of
Gumbel winners checked against the top-p mass (see ``kernels/sampling.py`` for the whole algorithm).

Why it is exact. The answer is ``argmax(s + g)`` over the kept set ``K = {s >= v_p}``. For any
value ``t``, ``K`` lies inside ``{s > t}`` exactly when ``M(t) = sum of e over s > t`` is at least
``top_p * Z`` (then ``v_p > t``); and a token ``w`` is in ``K`` exactly when ``M(s_w) < top_p * Z``
(the reference's cut: the mass strictly above ``w``'s value is below ``top_p * Z``). So with
``t_0 = -inf``, ``w_j`` the Gumbel winner over ``{s > t_j}`` and ``t_{j+1} = s_{w_j}``: the first
``w_j`` that passes the mass test is the answer (it wins a superset of ``K`` and lies in it). A
draw leaves the set ``K`` with probability ``1 - top_p``, so the first or second link decides
almost every row.

Where the winners come from. The scan pass keeps, per chunk of the row, the ``LIST_TOP`` tokens
with the best scores ``s + g`` (ranked by a cheap noise within 1e-5 of the exact one, then scored
exactly) and a bound every other token's exact score stays at or below: the best rough score of
what is left, or the runner-up of any position (a position sees several tokens in turn), plus the
rough noise's error (``_slack``). ``w_j``
is the best listed token above ``t_j``, and it is the true winner when its score beats every
chunk's bound. One pass over the row (in the level-1 launch) then sums ``Z`` and the masses above
the first ``CHAIN`` links, and the row's last program decides: the first link under the mass
bar, if it is provably the winner, is the token; otherwise (all links too low, or a link the
lists cannot prove) the row falls back to the histogram path of rows with top-k or min-p, from
the level-2 launch on. Masses are float32 sums in another order than the reference's cumsum, as
on the histogram path.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .sampling_common import (INT_MAX, NEG_INF, _finite_or_neg_inf, _max_and_first, _noise_at, _philox_words,
                              _scaled, _track_max)

LIST_TOP = 2   # best scores a chunk lists (H100, batch 32 and 64: 2 is 3-7 us faster than 4, no fallbacks)
CHAIN = 4      # links whose masses the check pass sums (1, 2 or 4)
STATE, TOKEN = tl.constexpr(8), tl.constexpr(9)   # zones columns: 0 undecided, 1 decided (TOKEN holds it), 2 fallen back to the histograms
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)      # lg2.approx: 2**-22 absolute in [0.5, 2], else 2 ulp
    else:
        return tl.log2(x)                   # the interpreter has no fast_log2f


@triton.jit
def _rough_gumbel(m, FAST: tl.constexpr):
    """``-log(-log(u))`` for ``u = (2m + 1) / 2**24`` (m: the top 23 bits of a Philox word) within
    about 1e-5, without the two accurate logarithms of ``sampling_common._gumbel``: ``L = -log(u)``
    from a series in ``d = 1 - u`` (exact in float32) where ``d <= 1/32`` and from lg2.approx
    elsewhere (relative error <= 6e-6), then ``-log(L)``. tests/test_sampling.py checks every m."""
    # u = 1 + m / 2**23 (its bits) - (1 - 2**-24): exact (Sterbenz), no integer conversion
    u = (m | 0x3F800000).to(tl.float32, bitcast=True) - 0.99999994039535522
    d = 1.0 - u                                       # exact where it is used (u >= 1/2)
    series = d * (1.0 + d * (0.5 + d * (0.3333333333 + d * (0.25 + d * 0.2))))
    big_l = tl.where(d <= 0.03125, series, -_log2(u, FAST) * LN2)
    return -_log2(big_l, FAST) * LN2


@triton.jit
def _rough_noise(start, seed, offset, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """:func:`_rough_gumbel` of tokens start .. start + BLOCK - 1: the Philox bits of ``_noise_block``."""
    r0, r1, r2, r3 = _philox_words(start // 4 + tl.arange(0, BLOCK // 4), seed, offset)
    return _rough_gumbel((tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK]) >> 9).to(tl.int32), FAST)


@triton.jit
def _slack(v):
    """How far a score from ``_rough_noise`` can lie from the exact one: its error, the two
    roundings of ``s + g`` and a margin (-inf stays -inf)."""
    return tl.where(v > NEG_INF, v + (1e-4 + 4e-7 * tl.abs(v)), v)


@triton.jit
def _is_chain(t, top_k, min_p, vocab):
    """Sampled rows without top-k and min-p (top-p or nothing) take the chain."""
    return (t > 0) & ((top_k <= 0) | (top_k >= vocab)) & (min_p <= 0)


@triton.jit
def _scan_chain(x_row, row_part, list_f, list_i, c, chunk, vocab, inv_t, seed, offset,
                BLOCK: tl.constexpr, T: tl.constexpr, FAST: tl.constexpr):
    """The raw max and its lowest index (as for every row) and the chunk's list: T tokens with the
    best scores (by rough noise, then scored exactly), their values, and a bound of every other
    token's exact score."""
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + c * chunk
    win = tl.full([BLOCK], NEG_INF, tl.float32)       # per position: the best rough score, its id ...
    wid = tl.zeros([BLOCK], tl.int32) + INT_MAX
    run = tl.full([BLOCK], NEG_INF, tl.float32)       # ... and the best one it did not keep
    end = tl.minimum(vocab, (c + 1) * chunk)         # the chunk's end: the next block is loaded ahead
    nxt = tl.load(x_row + c * chunk + tl.arange(0, BLOCK), mask=c * chunk + tl.arange(0, BLOCK) < end, other=NEG_INF)
    for off in range(0, chunk, BLOCK):
        start = c * chunk + off
        idx = start + tl.arange(0, BLOCK)
        x = _finite_or_neg_inf(nxt)
        nxt = tl.load(x_row + idx + BLOCK, mask=idx + BLOCK < end, other=NEG_INF)
        best, arg = _track_max(x, idx, best, arg)
        score = x * inv_t + _rough_noise(start, seed, offset, BLOCK, FAST)
        run = tl.maximum(run, tl.minimum(score, win))
        wid = tl.where(score > win, idx, wid)
        win = tl.maximum(win, score)
    m, first = _max_and_first(best, arg)
    tl.store(row_part, m)
    i = tl.arange(0, T)
    ids = tl.zeros([T], tl.int32) + INT_MAX
    for k in tl.static_range(T):
        top = tl.max(win, 0)
        top_id = tl.min(tl.where(win == top, wid, INT_MAX), 0)
        top_id = tl.where(top > NEG_INF, top_id, INT_MAX)
        ids = tl.where(i == k, top_id, ids)
        win = tl.where(wid == top_id, NEG_INF, win)
    ids = tl.sort(ids)                                # id order: see _links
    listed = ids < vocab
    s = _scaled(x_row, ids, vocab, inv_t)            # unlisted ids (INT_MAX) read as -inf
    tl.store(list_f + i, tl.where(listed, s + _noise_at(tl.where(listed, ids, 0), seed, offset), NEG_INF))
    tl.store(list_f + T + i, s)
    tl.store(list_i + i, ids)
    tl.store(list_f + 2 * T, _slack(tl.max(tl.maximum(win, run), 0)))
    return first


@triton.jit
def _links(list_f_ptr, list_i_ptr, row, num_chunks, J: tl.constexpr, T: tl.constexpr, C_PAD: tl.constexpr):
    """The chain from the row's lists: the values of links 0 .. 3 (scalars; -inf past J or where the
    chain ends) and (ids, provable) of links 0 .. J - 1 as (J,) tensors. Entries are in id order
    (chunks in turn, each list sorted by id), so the first of equal scores is the lowest id."""
    e = tl.arange(0, C_PAD * T)
    ok = e < num_chunks * T
    row_f = list_f_ptr + row * num_chunks * (2 * T + 1)
    row_i = list_i_ptr + row * num_chunks * T
    score = tl.load(row_f + (e // T) * (2 * T + 1) + e % T, mask=ok, other=NEG_INF)
    s = tl.load(row_f + (e // T) * (2 * T + 1) + T + e % T, mask=ok, other=NEG_INF)
    c = tl.arange(0, C_PAD)
    bound = tl.max(tl.load(row_f + c * (2 * T + 1) + 2 * T, mask=c < num_chunks, other=NEG_INF), 0)
    j = tl.arange(0, J)
    link_ids = tl.zeros([J], tl.int32) + INT_MAX
    proven = tl.zeros([J], tl.int32)
    floor_v = tl.full([], NEG_INF, tl.float32)
    v0, v1, v2, v3 = floor_v, floor_v, floor_v, floor_v
    for k in tl.static_range(J):
        top, at = tl.max(tl.where(s > floor_v, score, NEG_INF), 0, return_indices=True,
                         return_indices_tie_break_left=True)
        found = top > NEG_INF
        v = tl.where(found, tl.load(row_f + (at // T) * (2 * T + 1) + T + at % T), NEG_INF)
        link_ids = tl.where(j == k, tl.where(found, tl.load(row_i + at), INT_MAX), link_ids)
        proven = tl.where(j == k, (top > bound).to(tl.int32), proven)     # top > bound >= -inf
        floor_v = tl.where(found, v, float("inf"))
        if k == 0:
            v0 = v
        elif k == 1:
            v1 = v
        elif k == 2:
            v2 = v
        else:
            v3 = v
    return v0, v1, v2, v3, link_ids, proven


@triton.jit
def _check_chain(x_row, chain_f_ptr, list_f_ptr, list_i_ptr, zrow, s_max, row, c, chunk, num_chunks, vocab,
                 inv_t, top_p, BLOCK: tl.constexpr, J: tl.constexpr, T: tl.constexpr, C_PAD: tl.constexpr):
    """Level-1 work of a chain row: Z and the masses above each link over this chunk; the row's last
    program decides (zones STATE / TOKEN)."""
    if top_p < 1.0:
        end = tl.minimum(vocab, (c + 1) * chunk)
        nxt = tl.load(x_row + c * chunk + tl.arange(0, BLOCK), mask=c * chunk + tl.arange(0, BLOCK) < end,
                      other=NEG_INF)                  # in flight while the links are found
        v0, v1, v2, v3, link_ids, proven = _links(list_f_ptr, list_i_ptr, row, num_chunks, J, T, C_PAD)
        z = tl.zeros([BLOCK], tl.float32)
        a0 = tl.zeros([BLOCK], tl.float32)           # per position: the masses above links 0 .. 3
        a1 = tl.zeros([BLOCK], tl.float32)
        a2 = tl.zeros([BLOCK], tl.float32)
        a3 = tl.zeros([BLOCK], tl.float32)
        for off in range(0, chunk, BLOCK):
            s = _finite_or_neg_inf(nxt) * inv_t
            idx = c * chunk + off + BLOCK + tl.arange(0, BLOCK)          # the next block, loaded ahead
            nxt = tl.load(x_row + idx, mask=idx < end, other=NEG_INF)
            e = tl.exp(s - s_max)
            z += e
            a0 += tl.where(s > v0, e, 0.0)
            a1 += tl.where(s > v1, e, 0.0)
            a2 += tl.where(s > v2, e, 0.0)
            a3 += tl.where(s > v3, e, 0.0)
        slot = chain_f_ptr + (row * num_chunks + c) * 5
        tl.store(slot + 4, tl.sum(z, 0))
        tl.store(slot + tl.arange(0, 4), tl.sum(tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [BLOCK, 4]), 0))
        if tl.atomic_add(zrow + 7, 1) == num_chunks - 1:          # acq_rel: the others' sums are in
            cs = tl.arange(0, C_PAD)
            base = chain_f_ptr + (row * num_chunks + cs) * 5
            j = tl.arange(0, J)
            sums = tl.load(base[:, None] + j[None, :], mask=(cs < num_chunks)[:, None], other=0.0, cache_modifier=".cg")
            total = tl.sum(tl.load(base + 4, mask=cs < num_chunks, other=0.0, cache_modifier=".cg"), 0)
            under = tl.sum(sums, 0) < top_p * total               # (J,): the link lies in the kept set
            first = tl.min(tl.where(under, j, J), 0)
            ok = tl.sum(tl.where(j == first, proven, 0), 0) > 0
            tl.store(zrow + TOKEN, tl.sum(tl.where(j == first, link_ids, 0), 0))
            tl.store(zrow + STATE, tl.where(ok, 1, 2))
            tl.store(zrow + 7, 0)
    elif c == 0:                                                   # plain sampling: the first link
        v0, v1, v2, v3, link_ids, proven = _links(list_f_ptr, list_i_ptr, row, num_chunks, J, T, C_PAD)
        ok = tl.sum(tl.where(tl.arange(0, J) == 0, proven, 0), 0) > 0
        tl.store(zrow + TOKEN, tl.sum(tl.where(tl.arange(0, J) == 0, link_ids, 0), 0))
        tl.store(zrow + STATE, tl.where(ok, 1, 2))
