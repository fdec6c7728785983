"""Sample one token per row of float32 logits without sorting the vocabulary.

Semantics, tie rules and RNG are exactly ``fullgraph.sampling.sample_reference`` (see that module):
``s = logits * (1 / T)``; keep ``s >= v_k`` (top-k), then ``s >= v_p`` (top-p over the top-k mass), then
``exp(s - s_max) >= min_p``; the token is the Gumbel-max ``argmax(s + g)`` over the kept set, with
Philox4x32-10 noise keyed on the seed, counter ``(v >> 2, offset lo, offset hi, 0)``, lane ``v & 3``.

Algorithm: rows are split into C chunks; passes of (R, C) programs, then one of R programs.
1. ``_max_kernel``: per chunk, the max and lowest argmax of the raw logits (NaN as -inf). The greedy
   answer, and ``s_max = max * (1 / T)`` (the scaling is monotone).
2. ``_hist_kernel`` level 1 (rows with top-k or top-p only): each token's ``d = s_max - s`` falls
   in bucket ``floor(d * BPN)`` of 1/BPN nat (the last also takes d >= (NB - 1) / BPN, -inf and
   lanes past V): a count histogram per row (``tl.histogram``, one atomic add per program) and
   ``Z = sum exp(s - s_max)``. The row's last program to finish derives the zones: buckets
   ``< b_hi`` are kept by top-k and top-p for certain, buckets ``> b_lo`` dropped for certain (exact
   counts for top-k; for top-p the bounds ``exp(-(b+1)/BPN) <= e < exp(-b/BPN)`` on each token's
   mass; ``-log(min_p)`` for min-p).
3. ``_hist_kernel`` level 2 (rows whose undecided zone holds > REFINE_ABOVE tokens): the same over
   that zone split ``sub`` times finer (a power of two, so bucket edges stay exact), on top of the
   exact count and mass of the tokens above it. Positions ("pos") are level-2 buckets for such rows.
4. ``_compact_kernel``: sums the exact mass of the surely-kept zone, takes the Gumbel winner among its
   min-p survivors (noise only for blocks that hold one), and writes the ids of the undecided tokens
   (``b_hi <= pos <= b_lo``) to the chunk's segment of ``cand``.
5. ``_select_kernel``: exact ``v_k`` and ``v_p`` over the undecided tokens by a search on the
   order-preserving int32 key of s (counts, then masses, on top of the surely-kept zone's), the
   winner among the kept ones against the surely-kept winner; greedy rows take pass 1's argmax.
   Up to CAND_BLOCK undecided tokens are searched in registers. More are first narrowed with exact
   per-position counts and masses over the list (the threshold's position, < REFINE_BUCKETS past
   b_hi, is then searched in registers). Failing that (a bucket of > CAND_BLOCK tokens, e.g. a huge
   tie) an exact slow path re-reads the row at every search step.
Only float summation order differs from the reference, so results can differ only where a mass
sits within rounding of ``top_p * Z_k`` or two scores tie to the last bit. Capture-safe: grids and
workspaces come from shapes, every decision is made on the device.

Measured on an H200, V = 128256, batch 32, per call in a CUDA graph: greedy 14 us, min-p 41-53 us,
top-k 50 + top-p 0.95 106-108 us, top-p 0.9 147 us (the sort-based reference: 1.9 ms). Per pass:
max 6, level-1 histogram ~19, level-2 ~28, compact 29-55 (Philox noise for every kept token ~10 of
it), select 2-14 us.

Layout contract:
    logits:        (R, V) float32/bf16/fp16, ``stride(-1) == 1``
    temperature, top_p, min_p: (R,) float32; top_k: (R,) int32; seeds, offsets: (R,) int64
    returns:       (R,) int64 in [0, V)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl

NUM_BUCKETS = 256      # histogram buckets of d = s_max - s ...
BUCKETS_PER_NAT = 16   # ... each 1/16 nat wide: 16 nats before the overflow bucket
REFINE_ABOVE = 512     # undecided tokens past which a row gets the level-2 histogram
BLOCK = 4096           # tokens per loop step of the row passes
CAND_BLOCK = 4096      # undecided tokens the select pass holds in registers ...
CAND_SMALL = 512       # ... in a lighter variant when there are only a few
REFINE_BUCKETS = 64    # buckets below b_hi the select pass can narrow a large undecided zone to
LIST_BLOCK = 256       # tokens per step when the select pass walks the undecided list
NEG_INF = tl.constexpr(float("-inf"))
INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    for _ in tl.static_range(10):
        h0, h1 = tl.umulhi(c0, 0xD2511F53), tl.umulhi(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, c2 * 0xCD9E8D57, h0 ^ c3 ^ k1, c0 * 0xD2511F53
        k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _gumbel(bits):
    u = ((bits >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08    # (2m + 1) / 2**24
    return -tl.log(-tl.log(u))


@triton.jit
def _philox_words(blocks, seed, offset):
    z = tl.zeros(blocks.shape, tl.uint32)
    seed, offset = seed.to(tl.int64), offset.to(tl.int64)
    return _philox(blocks.to(tl.uint32), z + (offset & 0xFFFFFFFF).to(tl.uint32),
                   z + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32), z,
                   z + (seed & 0xFFFFFFFF).to(tl.uint32), z + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _noise_block(start, seed, offset, BLOCK: tl.constexpr):
    """Gumbel noise of tokens start .. start + BLOCK - 1 (start % 4 == 0): a Philox call per 4."""
    r0, r1, r2, r3 = _philox_words(start // 4 + tl.arange(0, BLOCK // 4), seed, offset)
    return _gumbel(tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK]))


@triton.jit
def _noise_at(ids, seed, offset):
    r0, r1, r2, r3 = _philox_words(ids // 4, seed, offset)
    lane = ids % 4
    return _gumbel(tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3))))


@triton.jit
def _key(s):
    """float32 -> int32 with the same order (-0.0 just below +0.0)."""
    b = s.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(x_row, idx, vocab, inv_t):
    x = tl.load(x_row + idx, mask=idx < vocab, other=NEG_INF).to(tl.float32)
    return tl.where(x == x, x, NEG_INF) * inv_t


@triton.jit
def _bucket(s, s_max, NB: tl.constexpr, BPN: tl.constexpr):
    d = s_max - s
    return tl.where(d < (NB - 1) / BPN, d * BPN, NB - 1).to(tl.int32)


@triton.jit
def _position(s, s_max, b_hi1, b_lo1, sub, NB: tl.constexpr, BPN: tl.constexpr):
    """The level-1 bucket, or with ``sub > 0`` the level-2 one inside level 1's undecided buckets
    (-1 above them, 2**30 below): exact, since ``d * BPN * sub`` only scales by a power of two."""
    b = _bucket(s, s_max, NB, BPN)
    inside = (b >= b_hi1) & (b <= b_lo1) & (b < NB - 1)    # level 2 never splits the open last bucket
    f = (tl.where(inside, s_max - s, 0.0) * (BPN * sub.to(tl.float32))).to(tl.int32) - b_hi1 * sub
    return tl.where(sub > 0, tl.where(b < b_hi1, -1, tl.where(inside, f, 2**30)), b)


@triton.jit
def _row_max(part_f_ptr, row, num_chunks, C_PAD: tl.constexpr):
    c = tl.arange(0, C_PAD)
    return tl.max(tl.load(part_f_ptr + (row * num_chunks + c) * 4, mask=c < num_chunks, other=NEG_INF), 0)


@triton.jit
def _row_sum(part_ptr, row, num_chunks, field, WIDTH: tl.constexpr, C_PAD: tl.constexpr):
    c = tl.arange(0, C_PAD)
    return tl.sum(tl.load(part_ptr + (row * num_chunks + c) * WIDTH + field, mask=c < num_chunks, other=0,
                          cache_modifier=".cg"), 0)


@triton.jit
def _min_p_bucket(min_p, d0, bpn, NB: tl.constexpr):
    """The last bucket that can hold a token with ``exp(-d) >= min_p`` (-1: none; NB - 1: any)."""
    lm = tl.where(min_p > 0, (-tl.log(tl.where(min_p > 0, min_p, 1.0)) - d0) * bpn, NB)
    inside = (lm >= 0) & (lm < NB - 2)
    return tl.where(lm < 0, -1, tl.where(inside, tl.where(inside, lm, 0.0).to(tl.int32) + 1, NB - 1))


@triton.jit
def _zones(cnt, z, top_k, top_p, min_p, vocab, n_above, m_above, d0, bpn, OPEN_LAST: tl.constexpr,
           NB: tl.constexpr):
    """(b_hi, b_lo, tokens before b_hi, tokens in b_hi .. b_lo) from counts of buckets covering
    ``d0 + [b, b + 1) / bpn`` (the last one unbounded if OPEN_LAST), below ``n_above`` tokens of
    exact mass ``m_above``."""
    b = tl.arange(0, NB)
    cum = n_above + tl.cumsum(cnt, 0)
    has_k = (top_k > 0) & (top_k < vocab)
    has_p = top_p < 1.0
    bf, cntf = b.to(tl.float32), cnt.to(tl.float32)
    w_lo = tl.exp(-(d0 + (bf + 1.0) / bpn))
    if OPEN_LAST:
        w_lo = tl.where(b < NB - 1, w_lo, 0.0)
    up = m_above * 1.0001 + tl.cumsum(cntf * tl.exp(-(d0 + bf / bpn)), 0) * 1.0001   # mass of buckets <= b
    low = m_above * 0.9999 + tl.cumsum(cntf * w_lo, 0) * 0.9999
    b_k = tl.sum((cum < top_k).to(tl.int32), 0)                            # bucket of the k-th largest
    above_k = tl.where(b_k > 0, tl.sum(tl.where(b == b_k - 1, cum, 0), 0), n_above)
    zk_lo = tl.where(b_k > 0, tl.sum(tl.where(b == b_k - 1, low, 0.0), 0), m_above * 0.9999) \
        + (top_k - above_k).to(tl.float32) * tl.sum(tl.where(b == b_k, w_lo, 0.0), 0) * 0.9999
    zk_hi = tl.sum(tl.where(b == b_k, up, 0.0), 0)
    zk_lo, zk_hi = tl.where(has_k, zk_lo, z * 0.9999), tl.where(has_k, zk_hi, z * 1.0001)
    hi_p = tl.sum((up < top_p * zk_lo).to(tl.int32), 0)                   # surely kept by top-p below
    lo_p = tl.minimum(tl.sum((low < top_p * zk_hi).to(tl.int32), 0), NB - 1)
    lo_m = _min_p_bucket(min_p, d0, bpn, NB)
    b_hi = tl.minimum(tl.where(has_k, b_k, NB), tl.where(has_p, hi_p, NB))
    # With top-k and top-p, Z_k needs every token down to the k-th: the undecided zone reaches b_k.
    b_lo = tl.minimum(tl.minimum(tl.where(has_k, b_k, NB - 1), tl.where(has_p, lo_p, NB - 1)), lo_m)
    b_lo = tl.where(has_k & has_p, b_k, b_lo)
    n_hi = tl.where(b_hi > 0, tl.sum(tl.where(b == b_hi - 1, cum, 0), 0), n_above)
    n_mid = tl.sum(tl.where((b >= b_hi) & (b <= b_lo), cnt, 0), 0)
    return b_hi, b_lo, n_hi, n_mid


@compile_ahead.kernel
@triton.jit
def _max_kernel(
        logits_ptr, part_f_ptr, part_i_ptr, hist_ptr, zones_ptr,       # pointers
        vocab, chunk, num_chunks,                                      # sizes
        stride_l,                                                      # strides
        NB: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if c == 0:                                       # the histogram's atomics and the arrival count
        tl.store(hist_ptr + row * NB + tl.arange(0, NB), tl.zeros([NB], tl.int32))
        tl.store(zones_ptr + row * 8 + 7, 0)
    best = tl.full([], NEG_INF, tl.float32)
    arg = c * chunk
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < vocab, other=NEG_INF).to(tl.float32)
        x = tl.where(x == x, x, NEG_INF)
        m = tl.max(x, 0)
        arg = tl.where(m > best, c * chunk + off + tl.argmax(x, 0, tie_break_left=True), arg)
        best = tl.maximum(best, m)
    tl.store(part_f_ptr + (row * num_chunks + c) * 4, best)
    tl.store(part_i_ptr + (row * num_chunks + c) * 3, arg)


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
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_f_ptr, hist_ptr, zones_ptr,  # pointers
        vocab, chunk, num_chunks, refine_above,                                                  # sizes
        stride_l,                                                                                # strides
        NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr, LEVEL: tl.constexpr,
        USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t, top_k, top_p = tl.load(temp_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    inv_t = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
    s_max = _row_max(part_f_ptr, row, num_chunks, C_PAD) * inv_t
    zrow = zones_ptr + row * 8
    go = (t > 0) & (s_max > NEG_INF) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    b_hi1, b_lo1, sub = 0, 0, 0
    if LEVEL == 2:                                   # only rows whose level-1 zone was too wide
        b_hi1, b_lo1, sub = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2)
        go = go & (sub > 0)
    if go:
        acc = tl.zeros([], tl.float32)              # Z (level 1), exact mass above the zone (level 2)
        hist = tl.zeros([NB], tl.int32)
        for off in range(0, chunk, BLOCK):
            s = _scaled(logits_ptr + row * stride_l, c * chunk + off + tl.arange(0, BLOCK), vocab, inv_t)
            e = tl.exp(s - s_max)
            if LEVEL == 1:
                acc += tl.sum(e, 0)
                pos = _bucket(s, s_max, NB, BPN)
            else:
                pos = _position(s, s_max, b_hi1, b_lo1, sub, NB, BPN)
                acc += tl.sum(tl.where(pos < 0, e, 0.0), 0)
                pos = tl.where((pos >= 0) & (pos < NB - 1), pos, NB - 1)
            hist += tl.histogram(pos, NB)
        tl.atomic_add(hist_ptr + row * NB + tl.arange(0, NB), hist, mask=hist > 0, sem="relaxed")
        tl.store(part_f_ptr + (row * num_chunks + c) * 4 + LEVEL, acc)
        if tl.atomic_add(zrow + 7, 1) == num_chunks - 1:          # acq_rel: the others' counts are in
            _level_zones(hist_ptr + row * NB, zrow, part_f_ptr, row, num_chunks, top_k, top_p,
                         tl.load(min_p_ptr + row), vocab, refine_above, LEVEL, NB, BPN, C_PAD)
            tl.store(zrow + 7, 0)


@compile_ahead.kernel
@triton.jit
def _compact_kernel(
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr,   # pointers
        part_f_ptr, part_i_ptr, zones_ptr, cand_ptr,
        vocab, chunk, num_chunks, seg_cap,                                             # sizes
        stride_l,                                                                      # strides
        NB: tl.constexpr, BPN: tl.constexpr, BLOCK: tl.constexpr, C_PAD: tl.constexpr,
        USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t, top_k, top_p = tl.load(temp_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    inv_t = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
    s_max = _row_max(part_f_ptr, row, num_chunks, C_PAD) * inv_t
    if (t > 0) & (s_max > NEG_INF):
        min_p, seed, offset = tl.load(min_p_ptr + row), tl.load(seed_ptr + row), tl.load(offset_ptr + row)
        zrow = zones_ptr + row * 8
        zero = tl.zeros([], tl.int32)                               # no top-k / top-p: min-p alone
        b_hi1, b_lo1, sub, b_hi, b_lo = zero, zero, zero, zero + NB, _min_p_bucket(min_p, 0.0, BPN, NB)
        if ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0):
            b_hi1, b_lo1, sub = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2)
            b_hi, b_lo = tl.load(zrow + 3), tl.load(zrow + 4)
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
                m = tl.max(score, 0)
                best_id = tl.where(m > best, start + tl.argmax(score, 0, tie_break_left=True), best_id)
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
def _list_ids(part_i_ptr, cand_ptr, row, num_chunks, seg_cap, start, N: tl.constexpr):
    """Ids at positions start .. start + N of the row's undecided list (the chunks' segments in
    chunk order), and which positions exist."""
    p = start + tl.arange(0, N)
    seg, base, total = tl.zeros([N], tl.int32), tl.zeros([N], tl.int32), 0
    for c in range(num_chunks):
        inside = p >= total
        seg, base = tl.where(inside, c, seg), tl.where(inside, total, base)
        total += tl.load(part_i_ptr + (row * num_chunks + c) * 3 + 2)
    ok = p < total
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
def _list_winner(x_row, part_i_ptr, cand_ptr, row, num_chunks, seg_cap, n_list, vocab, inv_t, s_max, v_k, v_p,
                 min_p, seed, offset, LB: tl.constexpr):
    """(score, id) of the Gumbel winner among the listed tokens passing v_k, v_p and min-p."""
    best, best_id = tl.full([], NEG_INF, tl.float32), INT_MAX
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(part_i_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB)
        s = _scaled(x_row, tl.where(ok, cid, vocab), vocab, inv_t)
        keep = ok & (s > NEG_INF) & (s >= v_k) & (s >= v_p) & (tl.exp(s - s_max) >= min_p)
        score = tl.where(keep, s + _noise_at(cid, seed, offset), NEG_INF)
        m = tl.max(score, 0)
        m_id = tl.min(tl.where(keep & (score == m), cid, INT_MAX), 0)
        best_id = tl.where((m > best) | ((m == best) & (m_id < best_id)), m_id, best_id)
        best = tl.maximum(best, m)
    return best, best_id


@triton.jit
def _bucket_search(x_row, part_i_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list, vocab,
                   inv_t, s_max, bucket, floor_v, base, target, BY_MASS: tl.constexpr, CB: tl.constexpr,
                   LB: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr):
    """:func:`_register_search` over the listed tokens at one position, packed into ``scratch_row``
    first; also returns how many there were (the result is valid only if <= CB)."""
    b_hi1, b_lo1, sub = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2)
    n = 0
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(part_i_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB)
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
def _refined_thresholds(x_row, part_i_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list, vocab,
                        inv_t, s_max, z, n_hi, mass_hi, top_k, top_p, CB: tl.constexpr, RB: tl.constexpr,
                        LB: tl.constexpr, NB: tl.constexpr, BPN: tl.constexpr):
    """(v_k, v_p, failed) for a large undecided list: exact counts and masses of its positions
    b_hi .. b_hi + RB - 1 pin each threshold to one position, searched in registers."""
    b_hi1, b_lo1, sub, b_hi = tl.load(zrow), tl.load(zrow + 1), tl.load(zrow + 2), tl.load(zrow + 3)
    r = tl.arange(0, RB)
    cnt, mass = tl.zeros([RB], tl.int32), tl.zeros([RB], tl.float32)
    for start in range(0, n_list, LB):
        cid, ok = _list_ids(part_i_ptr, cand_ptr, row, num_chunks, seg_cap, start, LB)
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
        v_k, m_k, n = _bucket_search(x_row, part_i_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list,
                                     vocab, inv_t, s_max, b_hi + r_k, v_k, n_hi + tl.sum(tl.where(r < r_k, cnt, 0), 0),
                                     top_k, False, CB, LB, NB, BPN)
        fail = (r_k >= RB) | (n > CB)
        z = mass_hi + tl.sum(tl.where(r < r_k, mass, 0.0), 0) + m_k
    v_p = tl.full([], NEG_INF, tl.float32)
    if top_p < 1.0:
        q = top_p * z
        r_p = tl.minimum(tl.sum((mass_hi + tl.cumsum(mass, 0) < q).to(tl.int32), 0), r_k)
        v_p, _, n = _bucket_search(x_row, part_i_ptr, cand_ptr, scratch_row, zrow, row, num_chunks, seg_cap, n_list,
                                   vocab, inv_t, s_max, b_hi + r_p, v_k, mass_hi + tl.sum(tl.where(r < r_p, mass, 0.0), 0),
                                   q, True, CB, LB, NB, BPN)
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
def _direct_thresholds(x_row, part_i_ptr, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t, s_max, z, n_hi,
                       mass_hi, top_k, top_p, CB: tl.constexpr, P: tl.constexpr):
    """(v_k, v_p) with the whole undecided list (<= CB tokens) in registers."""
    cid, ok = _list_ids(part_i_ptr, cand_ptr, row, num_chunks, seg_cap, 0, CB)
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
        CB: tl.constexpr, CB_SMALL: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
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
        zrow = zones_ptr + row * 8
        n_hi = tl.load(zrow + 5)
        x_row = logits_ptr + row * stride_l
        if n_list > 0:
            if n_list <= CB_SMALL:
                v_k, v_p = _direct_thresholds(x_row, part_i_ptr, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t,
                                              s_max, z, n_hi, mass_hi, top_k, top_p, CB_SMALL, 8)
            elif n_list <= CB:
                v_k, v_p = _direct_thresholds(x_row, part_i_ptr, cand_ptr, row, num_chunks, seg_cap, vocab, inv_t,
                                              s_max, z, n_hi, mass_hi, top_k, top_p, CB, 2)
            else:
                v_k, v_p, fail = _refined_thresholds(x_row, part_i_ptr, cand_ptr, scratch_ptr + row * CB, zrow,
                                                     row, num_chunks, seg_cap, n_list, vocab, inv_t, s_max, z,
                                                     n_hi, mass_hi, top_k, top_p, CB, RB, LB, NB, BPN)
                if fail:
                    v_k, v_p = _row_thresholds(x_row, zrow, vocab, inv_t, s_max, z, n_hi, mass_hi, top_k, top_p,
                                               NB, BPN, BLOCK)
            m, m_id = _list_winner(x_row, part_i_ptr, cand_ptr, row, num_chunks, seg_cap, n_list, vocab, inv_t,
                                   s_max, v_k, v_p, min_p, seed, offset, LB)
            best_id = tl.where((m > best) | ((m == best) & (m_id < best_id)), m_id, best_id)
            best = tl.maximum(best, m)
        token = tl.where(best > NEG_INF, best_id, token)
    tl.store(out_ptr + row, token.to(tl.int64))


@functools.cache
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def launch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *, block: int = BLOCK,
           num_chunks: int | None = None, cand_block: int = CAND_BLOCK, refine_above: int = REFINE_ABOVE,
           workspace: dict | None = None) -> torch.Tensor:
    """Launch the passes; ``block``, ``num_chunks``, ``cand_block`` and ``refine_above`` are tuning
    knobs (tests shrink them to reach every path on small vocabularies); a ``workspace`` dict
    receives the intermediate tensors (``zones``: see ``_level_zones``). Capture-safe."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    max_chunks = triton.cdiv(vocab, block)
    c = num_chunks or max(1, min(max_chunks, triton.cdiv(_target_programs(logits.device), rows)))
    c = min(c, max_chunks)
    chunk = triton.cdiv(triton.cdiv(vocab, c), block) * block
    c = triton.cdiv(vocab, chunk)
    dev = logits.device
    part_f = torch.empty(rows, c, 4, dtype=torch.float32, device=dev)   # max, Z, surely-kept mass, score
    part_i = torch.empty(rows, c, 3, dtype=torch.int32, device=dev)     # argmax, winner id, undecided
    hist = torch.empty(rows, NUM_BUCKETS, dtype=torch.int32, device=dev)
    zones = torch.empty(rows, 8, dtype=torch.int32, device=dev)   # see _level_zones; [7] arrival count
    cand = torch.empty(rows, c, chunk, dtype=torch.int32, device=dev)     # undecided ids, per chunk
    scratch = torch.empty(rows, cand_block, dtype=torch.int32, device=dev)
    if workspace is not None:
        workspace.update(part_f=part_f, part_i=part_i, hist=hist, zones=zones, cand=cand)
    # No FMA contraction: s = x * (1 / T) and s - s_max round exactly as in PyTorch.
    meta = dict(NB=NUM_BUCKETS, BLOCK=block, enable_fp_fusion=False, **pdl.options(logits))
    warps = 8 if block >= 2048 else 4
    _max_kernel[(rows, c)](logits, part_f, part_i, hist, zones, vocab, chunk, c, logits.stride(0),
                           num_warps=warps, **meta)
    meta.update(BPN=BUCKETS_PER_NAT, C_PAD=triton.next_power_of_2(c))
    params = (temperature, top_k, top_p, min_p, seeds, offsets)
    for level in (1, 2):
        _hist_kernel[(rows, c)](logits, temperature, top_k, top_p, min_p, part_f, hist, zones, vocab, chunk, c,
                                refine_above, logits.stride(0), LEVEL=level, num_warps=warps, **meta)
    _compact_kernel[(rows, c)](logits, *params, part_f, part_i, zones, cand, vocab, chunk, c, chunk,
                               logits.stride(0), num_warps=warps, **meta)
    _select_kernel[(rows,)](logits, *params, part_f, part_i, zones, cand, scratch, out, vocab, c, chunk,
                            logits.stride(0), CB=cand_block, CB_SMALL=max(16, min(CAND_SMALL, cand_block // 4)),
                            RB=REFINE_BUCKETS, LB=LIST_BLOCK, num_warps=16 if cand_block >= 4096 else 4, **meta)
    return out


@torch.library.custom_op("fullgraph::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(R,) int64 token ids; see the module docstring."""
    return launch(logits, temperature, top_k, top_p, min_p, seeds, offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
