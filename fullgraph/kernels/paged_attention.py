"""Paged attention over one step's varlen batch: prefill, chunked prefill, decode and mixed.

Algorithm: FlashAttention-2 forward (online softmax in base 2) over a paged KV cache, GQA-packed.

* A program owns one *query tile* of one KV head: BLOCK_Q consecutive new tokens of one request
  times the GROUP = H // KVH query heads sharing that KV head, packed as rows
  ``m -> (token m // GROUP, head m % GROUP)`` of a BLOCK_M-row score tile. Each K/V tile it loads
  serves all GROUP heads (GROUP times less KV traffic than one program per query head).
* The grid comes from static sizes only: ``(T // BLOCK_Q + R + 1) * KVH`` programs for a mixed
  step, ``R * KVH`` for a decode step (BLOCK_Q = 1, token i is request i), times NUM_SPLITS.
  A program finds its request by binary-searching ``tile_start[r] = query_start_loc[r] // BLOCK_Q
  + r`` on the device. That sequence is strictly increasing only while ``query_start_loc`` is
  non-decreasing: a padded tail of -1 sends programs to the wrong request. Index R is the padding
  pseudo-request (tokens ``query_start_loc[R] .. T-1``, no keys): its programs write zeros.
* Query token j of request r sits at position ``seq_lens[r] - q_len[r] + j`` and attends to the
  keys at positions ``<= `` its own, all read from the cache: position p lives in page
  ``block_table[r, p // PAGE_SIZE]`` at slot ``p % PAGE_SIZE``. Key tiles that every row of the
  program sees run unmasked; the rest (the causal diagonal, the sequence end) load K and V with
  ``other=0`` and set scores with ``where(mask, s, -inf)``, so stale or NaN cache memory (the null
  block, pages past seq_len) never reaches an output row.
* Sliding window ``W > 0`` (transformers' ``sliding_window_overlay``, ``kv_idx > q_idx -
  sliding_window``, and'ed with causal): position q sees key k iff ``k <= q and q - k < W``. The
  key loop starts at the tile of ``first = pos0 - W + 1`` (pos0: the program's first row): earlier
  tiles are skipped, never loaded. Tiles straddling some row's window start are masked and load
  only keys ``>= first``. W is a runtime int, so all window sizes share one variant; the constexpr
  ``SLIDING = 0 < W < max_kv_len`` keeps other layers on the unchanged causal kernel, bit for bit.
* Split-KV (decode only): split s covers key tiles ``[lo + s*per, lo + (s+1)*per)``, ``lo = first
  // BLOCK_N * BLOCK_N`` (0 without a window), ``per = cdiv(cdiv(seq_len - lo, BLOCK_N),
  NUM_SPLITS)``: the splits divide only the keys the loop walks; an empty one writes lse -inf. Each
  writes its normalised partial output and log2-sum-exp (float32) to caller-owned workspaces;
  ``split_kv_reduce`` merges them in a second launch, or (MERGE, given an ``arrivals`` counter per
  request and KV head) the last split to finish merges them in this one: every split counts itself
  in with an acq_rel atomic after its stores, the one that sees NUM_SPLITS - 1 resets the counter
  and reads the others' rows through L2 (``split_kv_reduce.merge_splits``). NUM_SPLITS comes from
  :func:`num_kv_splits` (``split_kv_reduce``), static sizes only.

Layout contract (T tokens, R requests, padded sizes; the launcher checks shapes):
    q:               (T, H, D) fp16/bf16/fp32, ``stride(-1) == 1``; output (T, H, D), q's dtype
    kv_cache:        (2, num_blocks, PAGE_SIZE, KVH, D), q's dtype, ``stride(-1) == 1``
    query_start_loc: (R + 1,) int32, non-decreasing, ``[R] <= T``; seq_lens: (R,) int32
    block_table:     (R, MB) int32; part_out / part_lse: flat float32 workspaces of at least
                     ``R * NUM_SPLITS * H * next_pow2(D)`` / ``R * NUM_SPLITS * H`` elements;
    arrivals:        (>= R * KVH,) int32, zero before and after the launch (MERGE only).
Every output row is written: tokens of no request (padding) get zeros.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .attention_config import KernelConfig, default_config  # noqa: F401 (KernelConfig: this kernel's public API)
from .split_kv_reduce import merge_chunk, merge_splits, split_kv_reduce
from .._compat import custom_op

LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max start: exp2(-inf - _NEG_BIG) = 0, never inf - inf


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs] with query_start_loc[r] // BLOCK_Q + r <= tile."""
    lo = tile * 0            # int32 tensors from the start (num_reqs == 1 arrives as a constant)
    hi = lo + num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load(ptrs, mask, NO_MASK: tl.constexpr):
    if NO_MASK:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _attend(acc, l_i, m_i, q, kv_ptr, table_ptr, start, first, seq_len, pos, window, qk_scale,
            stride_kv, stride_kb, stride_ks,
            MASKED: tl.constexpr, SLIDING: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
            HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax. MASKED tiles may hold keys
    past seq_len, past some row's position or before some row's window; they load only keys in
    [first, seq_len) (the others may be freed pages). Unmasked ones hold only keys every row sees."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_ok = n < seq_len
    if SLIDING:
        n_ok = n_ok & (n >= first)
    if MASKED:
        page = tl.load(table_ptr + n // PAGE_SIZE, mask=n_ok, other=0)
    else:
        page = tl.load(table_ptr + n // PAGE_SIZE)
    off = page.to(tl.int64) * stride_kb + (n % PAGE_SIZE) * stride_ks       # (BLOCK_N,)
    k_ptrs = kv_ptr + off[None, :] + d[:, None]                             # (D_PAD, BLOCK_N)
    v_ptrs = kv_ptr + stride_kv + off[:, None] + d[None, :]                 # (BLOCK_N, D_PAD)
    if MASKED:
        k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = _load(k_ptrs, d_ok[:, None], HEAD_DIM == HEAD_DIM_PAD)
        v = _load(v_ptrs, d_ok[None, :], HEAD_DIM == HEAD_DIM_PAD)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale             # (BLOCK_M, BLOCK_N)
    if MASKED:
        seen = n[None, :] <= pos[:, None]
        if SLIDING:
            seen = seen & (n[None, :] > pos[:, None] - window)
        s = tl.where(seen & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# The per-bucket counts are runtime values, never specialised on (Triton would compile a variant
# per pattern of "== 1" / "divisible by 16" across the captured buckets, ~1 s of capture each);
# NUM_SPLITS stays a constant: a runtime split count cost 7% of the batch-32 decode step.
@compile_ahead.kernel
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_tiles", "window"])
def _paged_attention_kernel(
        # pointers
        out_ptr, q_ptr, kv_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
        part_out_ptr, part_lse_ptr, arrivals_ptr,
        # sizes
        num_tokens, num_reqs, num_tiles, num_kv_heads, max_kv_len, window, qk_scale,
        # strides (elements)
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv, stride_kb, stride_ks, stride_kh, stride_bt,
        # meta
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
        MERGE: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    tile = num_tiles - 1 - pid // num_kv_heads   # last (longest) query tiles launch first
    split = tl.program_id(1)

    if DECODE:  # R == T: program `tile` is request `tile` and token `tile`
        req = tile
        q_len = tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req)
        seq_len = tl.where(q_len > 0, tl.load(seq_lens_ptr + req), 0)
        q_end = req + 1
        q0 = req
        pos0 = seq_len - 1
    else:
        req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
        real = req < num_reqs                    # req == num_reqs: the padding pseudo-request
        q_start = tl.load(query_start_loc_ptr + req)
        q_end = tl.load(query_start_loc_ptr + req + 1, mask=real, other=num_tokens)
        seq_len = tl.load(seq_lens_ptr + req, mask=real, other=0)
        q0 = q_start + (tile - q_start // BLOCK_Q - req) * BLOCK_Q
        if q0 >= q_end:
            return
        pos0 = seq_len - q_end + q0              # position of the tile's first token

    # Rows of the tile: (token, query head) pairs of this KV head's group.
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    tok = q0 + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (tok < q_end) & (tok >= 0) & (tok < num_tokens)
    pos = pos0 + m // GROUP
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)

    # Keys [lo, hi): hi = last row position + 1; [lo, mid) is visible to every row (no mask).
    # SLIDING: lo = the tile of the first row's window start, and the tiles before edge (the last
    # row's window start, rounded up to a tile) are masked too.
    seq_len = tl.minimum(seq_len, max_kv_len)
    hi = tl.maximum(tl.minimum(pos0 + tl.minimum(BLOCK_Q, q_end - q0), seq_len), 0)
    full = (tl.maximum(tl.minimum(pos0 + 1, hi), 0) // BLOCK_N) * BLOCK_N
    lo, first, edge = 0, 0, 0
    if SLIDING:
        first = tl.maximum(pos0 - window + 1, 0)
        lo = (first // BLOCK_N) * BLOCK_N
        edge = tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)
    mid = tl.minimum(tl.maximum(full, lo), hi)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    kv_ptr += kv_head * stride_kh
    table_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    if SLIDING:
        edge = tl.minimum(tl.maximum(edge, lo), hi)
        for start in range(lo, edge, BLOCK_N):
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv_ptr, table_ptr, start, first, seq_len, pos, window,
                                    qk_scale, stride_kv, stride_kb, stride_ks, True, True, BLOCK_N, HEAD_DIM,
                                    HEAD_DIM_PAD, PAGE_SIZE, DOT_PRECISION)
        lo = edge
        mid = tl.minimum(tl.maximum(full, lo), hi)
    for start in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv_ptr, table_ptr, start, first, seq_len, pos, window,
                                qk_scale, stride_kv, stride_kb, stride_ks, False, SLIDING, BLOCK_N, HEAD_DIM,
                                HEAD_DIM_PAD, PAGE_SIZE, DOT_PRECISION)
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv_ptr, table_ptr, start, first, seq_len, pos, window,
                                qk_scale, stride_kv, stride_kb, stride_ks, True, SLIDING, BLOCK_N, HEAD_DIM,
                                HEAD_DIM_PAD, PAGE_SIZE, DOT_PRECISION)

    # Rows with no key (padding, empty split) have l_i == 0: output 0, log-sum-exp -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])
    else:
        prow = ((req * NUM_SPLITS + split) * (num_kv_heads * GROUP) + head).to(tl.int64)
        tl.store(part_out_ptr + prow[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + prow, lse, mask=row_ok)
        if MERGE:  # the (request, KV head)'s last split to finish merges them all
            tl.debug_barrier()                     # every thread's partial rows are written ...
            arrival = arrivals_ptr + req * num_kv_heads + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel") == NUM_SPLITS - 1:   # ... before it counts
                tl.atomic_xchg(arrival, 0, sem="relaxed")                    # ready for the next launch
                merge_splits(out_ptr, part_out_ptr, part_lse_ptr, req, tok, head, row_ok, d,
                              num_kv_heads * GROUP, stride_ot, stride_oh, NUM_SPLITS, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD,
                              triton.next_power_of_2(NUM_SPLITS), CHUNK)


@custom_op("fullgraph::paged_attention", mutates_args=("part_out", "part_lse", "arrivals"))
def _paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, part_out: torch.Tensor,
                        part_lse: torch.Tensor, arrivals: torch.Tensor, scale: float, decode_only: bool,
                        num_splits: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                        window: int = 0) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_reqs, max_blocks = block_table.shape
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = 1 if decode_only else block_m // group
    num_tiles = num_reqs if decode_only else num_tokens // block_q + num_reqs + 1
    sliding = 0 < window < max_blocks * page_size   # a wider window masks nothing: the plain kernel
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = compile_ahead.output(q.shape, q.dtype, q.device)       # (T, H, D)
    merge = num_splits > 1 and decode_only and arrivals.numel() > 0   # the splits merged in this launch
    _paged_attention_kernel[(num_tiles * num_kv_heads, num_splits)](
        out, q, kv_cache, query_start_loc, seq_lens, block_table, part_out, part_lse, arrivals,
        num_tokens, num_reqs, num_tiles, num_kv_heads, max_blocks * page_size, window if sliding else 0, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, DECODE=decode_only,
        SLIDING=sliding, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MERGE=merge,
        CHUNK=merge_chunk(num_splits, block_m, head_dim_pad, num_warps) if merge else 1,
        num_warps=num_warps, num_stages=num_stages, **pdl.options(q))
    if num_splits > 1 and not merge:
        split_kv_reduce(out=out, part_out=part_out, part_lse=part_lse, num_splits=num_splits)
    return out


@_paged_attention_op.register_fake
def _(q, kv_cache, query_start_loc, seq_lens, block_table, part_out, part_lse, arrivals, scale, decode_only,
      num_splits, block_m, block_n, num_warps, num_stages, window=0):
    return q.new_empty(q.shape)


def _check(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor, decode_only: bool) -> None:
    """Shape/dtype contract (static properties only: safe inside capture)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"paged_attention: q must be (T, H, D) and kv_cache (2, NB, page, KVH, D); "
                         f"got q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}")
    if q.shape[1] % kv_cache.shape[3] or kv_cache.stride(-1) != 1 or kv_cache.dtype != q.dtype:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads over {kv_cache.shape[3]} KV heads, "
                         f"kv_cache dtype {kv_cache.dtype} (q: {q.dtype}), stride {kv_cache.stride()}")
    r = block_table.shape[0]
    if query_start_loc.shape != (r + 1,) or seq_lens.shape != (r,) or block_table.dim() != 2:
        raise ValueError(f"paged_attention: query_start_loc {tuple(query_start_loc.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)}: expected (R+1,), (R,), (R, MB)")
    if any(t.dtype != torch.int32 for t in (query_start_loc, seq_lens, block_table)):
        raise ValueError("paged_attention: query_start_loc, seq_lens and block_table must be int32, got "
                         f"{query_start_loc.dtype}, {seq_lens.dtype}, {block_table.dtype}")
    if decode_only and r != q.shape[0]:
        raise ValueError(f"paged_attention: a decode step needs one token per request, got T={q.shape[0]}, R={r}")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, *, scale: float, decode_only: bool,
                    num_splits: int = 1, part_out: torch.Tensor | None = None,
                    part_lse: torch.Tensor | None = None, arrivals: torch.Tensor | None = None,
                    config: KernelConfig | None = None, window: int = 0, num_sms: int | None = None) -> torch.Tensor:
    """Causal attention of the step's new tokens over their requests' paged KV (module docstring).

    ``window`` > 0: sliding window, position q sees key k iff ``k <= q and q - k < window``
    (transformers' ``sliding_window_causal_mask_function``); pages before every row's window are
    never read, so their block-table entries may point anywhere (the null block). 0: full causal.
    Capture-safe: the grid, tiles and split count depend on shapes and arguments only. ``num_splits
    > 1`` (decode steps only) needs float32 workspaces ``part_out``/``part_lse`` (flat, see the
    layout contract), allocated once by the caller. With ``arrivals`` (int32, at least ``R * KVH``
    elements, all zero; the kernel leaves them zero) the last split of each (request, KV head) to
    finish merges the partials in the same launch; without it a second launch
    (``split_kv_reduce``) does. ``num_sms``: the GPU's SM count (a backend's static fact), which
    lets ``default_config`` pick long-program tiles for a decode step that leaves them few
    programs; None: never. Returns (T, H, D) in q's dtype.
    """
    _check(q, kv_cache, query_start_loc, seq_lens, block_table, decode_only)
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"paged_attention: window={window!r}: expected a Python int >= 0 (0 = no window), "
                         f"one static value per layer")
    if num_splits < 1 or (num_splits > 1 and not decode_only):
        raise ValueError(f"paged_attention: num_splits={num_splits}: must be 1, or >= 1 on decode steps")
    num_tokens, num_heads, head_dim = q.shape
    if num_splits > 1:
        rows = block_table.shape[0] * num_splits * num_heads
        need = (rows * (1 << (head_dim - 1).bit_length()), rows)   # (plain Python: compile traces this)
        have = tuple(-1 if t is None else t.numel() for t in (part_out, part_lse))
        if have[0] < need[0] or have[1] < need[1] or part_out.dtype != torch.float32 or part_lse.dtype != torch.float32:
            raise ValueError(f"paged_attention: {num_splits} splits need float32 workspaces of {need} "
                             f"elements, got {have}")
        if arrivals is not None and (arrivals.dtype != torch.int32 or arrivals.numel() < block_table.shape[0]
                                     * kv_cache.shape[3]):
            raise ValueError(f"paged_attention: arrivals must be int32 with at least R * KVH = "
                             f"{block_table.shape[0] * kv_cache.shape[3]} elements, got {arrivals.dtype} "
                             f"{tuple(arrivals.shape)}")
    else:
        part_out = part_lse = q.new_empty(0, dtype=torch.float32)
    if arrivals is None or num_splits == 1:
        arrivals = q.new_empty(0, dtype=torch.int32)
    max_kv_len = block_table.shape[1] * kv_cache.shape[2]
    span = window if 0 < window < max_kv_len else max_kv_len     # keys one decode program walks at most
    programs = block_table.shape[0] * kv_cache.shape[3] * num_splits
    cfg = config or default_config(head_dim, q.dtype, decode_only, keys_per_split=-(-span // num_splits),
                                   programs_per_sm=programs / num_sms if num_sms else None)
    return _paged_attention_op(
        q, kv_cache, query_start_loc, seq_lens, block_table, part_out, part_lse, arrivals, float(scale),
        bool(decode_only), int(num_splits), cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
        window)


@dataclass(frozen=True)
class KeysRead:
    """Key positions one decode step reads for one request (per KV head; K and V rows each)."""

    loaded: int   # rows loaded from the cache: the window's keys (masked lanes load nothing)
    walked: int   # positions the loop scores: from the start of the window's first tile to seq_len
    dense: int    # rows a full-causal decode loads: the whole sequence


def keys_read(seq_lens: Sequence[int], window: int, block_n: int) -> list[KeysRead]:
    """What the decode kernel reads per request at these lengths (host-side, for benchmarks:
    KV bytes = loaded * num_kv_heads * head_dim * 2 * itemsize). Splits do not change it."""
    firsts = [max(n - window, 0) if window else 0 for n in seq_lens]   # first key a decode sees
    return [KeysRead(n - f, n - f // block_n * block_n, n) for n, f in zip(seq_lens, firsts)]
