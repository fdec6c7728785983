"""Block-sparse paged decode attention, GQA-packed, with split-KV (one new token per request).

Algorithm: the token of request r sits at position ``p = seq_len - 1``, in sparse query block
``qb = p // sparse_block``. Program (KV head k, split s, request r) owns the G = H / KVH query
heads of k, packed as the rows of a BLOCK_M-row tile, and takes the s-th of ``num_splits`` equal
shares of row ``(k, qb)`` of the group layout: the union of the key blocks those heads keep, each
with a bit per head. Every kept block is read once for the whole group (a per-head program would
read the shared local window G times): a key tile goes through ``block_table`` (a page per tile
when pages are at least as large as the tile, else a page per token), scores ``q @ k^T`` for all
G rows at once, and rows whose head does not keep the block, and keys at or past ``seq_len``,
score -inf before the online softmax (loads use ``other=0``, so poisoned cache memory never
reaches a result). With one split the program writes the normalised rows directly; otherwise it
writes per-head (o, m, l) partials into caller-owned persistent buffers and
``blocksparse_reduce`` merges them, or, given an ``arrivals`` counter per (request, KV head), the
last split to finish merges them in the same launch (each split counts itself in with an acq_rel
atomic after its stores; the last resets the counter and reads the others' rows through L2).

Capture-safe: grid ``(KVH, num_splits, R)`` from static sizes; lengths are read on the device;
the number of splits must be a function of static values (``decode_num_splits``). Padded
requests (seq_len 0) produce zeros.

Tensor layout contract:
    q:           (R, H, D); token r belongs to request r (a decode-only step)
    kv_cache:    (2, num_pages, page_size, KVH, D), dtype of q; H % KVH == 0
    seq_lens:    (R,) int32 (0 for padded requests); block_table: (R, MB) int32
    counts, entries: a ``BlockSparseGroupLayout`` of the layer's heads, (KVH, NQB) and
                 (KVH, NQB, W) int32, entry ``kb << GROUP_BITS | bits`` (bit g: head kvh * G + g)
    partial_out: (>= R*H*S, D) float32; partial_ml: (>= R*H*S, 2) float32 (unused when S == 1)
    returns:     (R, H, D), dtype of q
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .blocksparse_prefill import check_paged_inputs, dot_precision
from .blocksparse_reduce import blocksparse_reduce, merge_split_rows
from .._compat import custom_op

GROUP_BITS = 16  # entry = kb << GROUP_BITS | head bits (the group layout's format; kernels import no layout code)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max start: exp2(-inf - _NEG_BIG) = 0, never inf - inf


@compile_ahead.kernel
@triton.jit(do_not_specialize=["num_splits"])
def _blocksparse_decode_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_ml_ptr, arrivals_ptr,
    seq_lens_ptr, block_table_ptr, counts_ptr, entries_ptr,
    # sizes
    num_q_blocks, num_splits, qk_scale,
    # strides
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv_page, stride_kv_tok, stride_kv_head,
    stride_bt_req, stride_counts_head, stride_ent_head, stride_ent_qb,
    # meta-parameters
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MERGE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    TILES: tl.constexpr = SPARSE_BLOCK // BLOCK_N     # key tiles per sparse block
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m                   # (BLOCK_M,) query heads of the group

    seq_len = tl.load(seq_lens_ptr + req)
    qb = tl.minimum(tl.maximum(seq_len - 1, 0) // SPARSE_BLOCK, num_q_blocks - 1)
    count = tl.load(counts_ptr + kv_head * stride_counts_head + qb)
    count = tl.where(seq_len > 0, count, 0)
    share = tl.cdiv(count, num_splits)
    first = split * share
    last = tl.minimum(first + share, count)
    ent_row = entries_ptr + kv_head * stride_ent_head + qb * stride_ent_qb
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_off = kv_head * stride_kv_head

    q = tl.load(q_ptr + req.to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)                                # (BLOCK_M, D)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for i in range(first * TILES, last * TILES):
        entry = tl.load(ent_row + i // TILES)
        kb = entry >> GROUP_BITS
        keeps = ((entry >> offs_m) & 1) == 1                                    # (BLOCK_M,) rows that keep kb
        start = kb * SPARSE_BLOCK + (i % TILES) * BLOCK_N
        kpos = start + offs_n
        k_ok = kpos < seq_len
        if PAGE_SIZE >= BLOCK_N:
            page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
            kv_addr = page * stride_kv_page + (start % PAGE_SIZE + offs_n) * stride_kv_tok + kv_off
        else:
            page = tl.load(bt_row + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_addr = page * stride_kv_page + (kpos % PAGE_SIZE) * stride_kv_tok + kv_off
        k = tl.load(k_cache_ptr + kv_addr[None, :] + offs_d[:, None], mask=k_ok[None, :], other=0.0)   # (D, N)
        v = tl.load(v_cache_ptr + kv_addr[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)   # (N, D)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale               # (BLOCK_M, N), log2 domain
        s = tl.where(keeps[:, None] & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if num_splits == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + req.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # per-head partials, the layout blocksparse_reduce merges
        part = (req.to(tl.int64) * (tl.num_programs(0) * GROUP) + head) * num_splits + split     # (BLOCK_M,)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(partial_ml_ptr + part * 2, tl.where(l_i > 0.0, m_i, float("-inf")), mask=row_ok)
        tl.store(partial_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if MERGE:  # the (request, KV head)'s last split to finish merges them all
            tl.debug_barrier()                     # every thread's partial rows are written ...
            arrival = arrivals_ptr + req * tl.num_programs(0) + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel") == num_splits - 1:   # ... before it counts
                tl.atomic_xchg(arrival, 0, sem="relaxed")                    # ready for the next launch
                merge_split_rows(partial_out_ptr, partial_ml_ptr, out_ptr + req.to(tl.int64) * stride_o_tok,
                                 part - split, head, row_ok, offs_d, num_splits, stride_o_head, BLOCK_M, HEAD_DIM)


def decode_num_splits(num_reqs: int, num_kv_heads: int, layout_width: int, sparse_block_size: int, *,
                      target_programs: int = 1024, min_keys_per_split: int = 128, max_splits: int = 32) -> int:
    """KV splits per (request, KV head): a function of static sizes only (capture-safe).

    Enough programs to fill the GPU (``target_programs``), but no split shorter than
    ``min_keys_per_split`` keys of the widest group-layout row. Measured on H200
    (``sweep_decode_attention.py --long``): batch 16 at 128K takes 1.03 ms with 8 splits (1024
    programs) against 1.23 ms with 4; batch 1 is fastest at 32 splits (64 or 128: no better).
    """
    by_length = max(1, layout_width * sparse_block_size // min_keys_per_split)
    by_occupancy = max(1, -(-target_programs // max(1, num_reqs * num_kv_heads)))
    return max(1, min(max_splits, by_length, by_occupancy))


def _check(q, kv_cache, seq_lens, block_table, counts, entries, partial_out, partial_ml, sparse_block_size,
           num_splits) -> None:
    """Shape/dtype/device checks (static facts only: safe inside capture)."""
    check_paged_inputs(q, kv_cache, block_table, counts, entries, sparse_block_size, per_kv_head=True)
    num_reqs, num_heads, head_dim = q.shape
    if num_heads // kv_cache.shape[3] > GROUP_BITS:
        raise ValueError(f"block-sparse decode takes at most {GROUP_BITS} query heads per KV head, got "
                         f"{num_heads} / {kv_cache.shape[3]}")
    if seq_lens.shape[0] != num_reqs or block_table.shape[0] != num_reqs:
        raise ValueError(f"decode: q has {num_reqs} tokens but seq_lens {tuple(seq_lens.shape)} and block_table "
                         f"{tuple(block_table.shape)}: a decode-only step has one token per request")
    if num_reqs > 65535 or not 1 <= num_splits <= 65535:
        raise ValueError(f"blocksparse decode: {num_reqs} requests x {num_splits} splits exceed the grid limits")
    rows = num_reqs * num_heads * num_splits
    if num_splits > 1 and (partial_out.shape[0] < rows or partial_ml.shape[0] < rows
                           or partial_out.shape[1:] != (head_dim,) or partial_ml.shape[1:] != (2,)):
        raise ValueError(f"decode workspace too small: need ({rows}, {head_dim}) and ({rows}, 2), got "
                         f"{tuple(partial_out.shape)} and {tuple(partial_ml.shape)}")


def _launch_decode(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   counts: torch.Tensor, entries: torch.Tensor, partial_out: torch.Tensor,
                   partial_ml: torch.Tensor, arrivals: torch.Tensor, sm_scale: float, sparse_block_size: int,
                   num_splits: int) -> torch.Tensor:
    _check(q, kv_cache, seq_lens, block_table, counts, entries, partial_out, partial_ml, sparse_block_size,
           num_splits)
    num_reqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = compile_ahead.output(q.shape, q.dtype, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    merge = num_splits > 1 and arrivals.numel() > 0              # the splits merged in this launch
    if merge and (arrivals.dtype != torch.int32 or arrivals.numel() < num_reqs * num_kv_heads):
        raise ValueError(f"blocksparse decode: arrivals must be int32 with at least R * KVH = "
                         f"{num_reqs * num_kv_heads} elements, got {arrivals.dtype} {tuple(arrivals.shape)}")
    _blocksparse_decode_kernel[(num_kv_heads, num_splits, num_reqs)](
        q, k_cache, v_cache, out, partial_out, partial_ml, arrivals, seq_lens, block_table, counts, entries,
        counts.shape[1], num_splits, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), counts.stride(0), entries.stride(0), entries.stride(1),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)),
        SPARSE_BLOCK=sparse_block_size, PAGE_SIZE=page_size, BLOCK_N=min(sparse_block_size, 64),
        GROUP_BITS=GROUP_BITS, DOT_PRECISION=dot_precision(q.dtype), MERGE=merge,
        num_warps=4, num_stages=2 if q.is_cuda else 1, **pdl.options(q))
    if num_splits > 1 and not merge:
        rows = num_reqs * num_heads * num_splits
        blocksparse_reduce(partial_out[:rows].view(num_reqs, num_heads, num_splits, head_dim),
                           partial_ml[:rows].view(num_reqs, num_heads, num_splits, 2), out)
    return out


@custom_op("fullgraph::blocksparse_decode", mutates_args=("partial_out", "partial_ml", "arrivals"))
def _blocksparse_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, counts: torch.Tensor, entries: torch.Tensor,
                           partial_out: torch.Tensor, partial_ml: torch.Tensor, arrivals: torch.Tensor,
                           sm_scale: float, sparse_block_size: int, num_splits: int) -> torch.Tensor:
    return _launch_decode(q, kv_cache, seq_lens, block_table, counts, entries, partial_out, partial_ml, arrivals,
                          sm_scale, sparse_block_size, num_splits)


@_blocksparse_decode_op.register_fake
def _(q, kv_cache, seq_lens, block_table, counts, entries, partial_out, partial_ml, arrivals, sm_scale,
      sparse_block_size, num_splits):
    return torch.empty_like(q)


def blocksparse_decode(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       counts: torch.Tensor, entries: torch.Tensor, partial_out: torch.Tensor,
                       partial_ml: torch.Tensor, *, sm_scale: float, sparse_block_size: int,
                       num_splits: int, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse decode attention (see the module docstring for the layout contract).

    ``counts``/``entries`` are a ``BlockSparseGroupLayout``'s (``build_group_layout``).
    ``partial_out``/``partial_ml`` are persistent float32 workspaces owned by the caller (rows
    ``>= R * H * num_splits``); they are scratch, overwritten on every call. With ``arrivals``
    (int32, ``>= R * KVH`` elements, zero before and after) the last split of each (request, KV
    head) merges in this launch instead of ``blocksparse_reduce``'s. Capture-safe; runs as the
    ``fullgraph::blocksparse_decode`` custom op. Returns a new (R, H, D) tensor.
    """
    if arrivals is None or num_splits == 1:
        arrivals = q.new_empty(0, dtype=torch.int32)
    return _blocksparse_decode_op(q, kv_cache, seq_lens, block_table, counts, entries, partial_out, partial_ml,
                                  arrivals, float(sm_scale), int(sparse_block_size), int(num_splits))
