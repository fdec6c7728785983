"""Shared pieces of the sampling kernel (``kernels.sampling``): constants, Philox4x32-10 and
Gumbel noise, the order-preserving key of a score, the bucketing of ``d = s_max - s`` and the
zones a histogram decides. See ``kernels/sampling.py`` for the algorithm."""
from __future__ import annotations

import triton
import triton.language as tl

NUM_BUCKETS = 256      # histogram buckets of d = s_max - s ...
BUCKETS_PER_NAT = 16   # ... each 1/16 nat wide: 16 nats before the overflow bucket
REFINE_ABOVE = 512     # undecided tokens past which a row gets the level-2 histogram
BLOCK = 1024           # tokens per loop step of the row passes from 16 rows (sweeps: 4-8 programs per SM)
CAND_BLOCK = 4096      # undecided tokens the select pass holds in registers ...
CAND_SMALL = 512       # ... in a lighter variant when there are only a few
REFINE_BUCKETS = 64    # buckets below b_hi the select pass can narrow a large undecided zone to
LIST_BLOCK = 256       # tokens per step when the select pass walks the undecided list
ZONES_W = tl.constexpr(16)   # ints a row's zones hold (see sampling_hist._level_zones, sampling_chain)
THRESHOLDS = tl.constexpr(10)   # zones columns 10, 11: the float bits of v_k and v_p where the select pass found them
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
def _finite_or_neg_inf(x):
    """Logits as float32, NaN as -inf."""
    x = x.to(tl.float32)
    return tl.where(x == x, x, NEG_INF)


@triton.jit
def _raw(x_row, idx, vocab):
    """The logits at ``idx`` as float32 (NaN and lanes past V as -inf)."""
    return _finite_or_neg_inf(tl.load(x_row + idx, mask=idx < vocab, other=NEG_INF))


@triton.jit
def _scaled(x_row, idx, vocab, inv_t):
    return _raw(x_row, idx, vocab) * inv_t


@triton.jit
def _track_max(x, idx, best, arg):
    """Per lane, the running max and its first index (a lane's ids grow, so ">" keeps the lowest):
    one reduction after a row pass's loop (``_max_and_first``), not two a step."""
    return tl.maximum(best, x), tl.where(x > best, idx, arg)


@triton.jit
def _max_and_first(best, arg):
    """The chunk's max and its lowest index, from ``_track_max``'s lanes."""
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, arg, INT_MAX), 0)


@triton.jit
def _chunk_max(x_row, c, chunk, vocab, BLOCK: tl.constexpr):
    """Chunk ``c``'s raw max (NaN as -inf) and its lowest index: the greedy rows' scan, and
    ``kernels/argmax.py``'s first launch."""
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + c * chunk
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        best, arg = _track_max(_raw(x_row, idx, vocab), idx, best, arg)
    return _max_and_first(best, arg)


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
