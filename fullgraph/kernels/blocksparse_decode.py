"""Block-sparse paged decode attention with split-KV (one new token per request).

Algorithm: the token of request r sits at position ``p = seq_len - 1``, in sparse query block
``qb = p // sparse_block``. Program (head h, split s, request r) takes the s-th of ``num_splits``
equal shares of row ``(h, qb)`` of the layout (the kept key blocks only: the local window and the
head's vertical blocks) and runs an online softmax over them, reading each key tile through
``block_table`` (a page per tile when pages are at least as large as the tile, else a page per
token). Keys at or past ``seq_len`` are masked: loads use ``other=0`` and scores become -inf via
``tl.where``, so poisoned cache memory never reaches a result. With one split the program writes
the normalised output directly; otherwise it writes (o, m, l) partials into caller-owned
persistent buffers and ``blocksparse_reduce`` merges them.

Capture-safe: grid ``(H, num_splits, R)`` from static sizes; lengths are read on the device; the
number of splits must be a function of static values (``decode_num_splits``). Padded requests
(seq_len 0) produce zeros.

Tensor layout contract:
    q:           (R, H, D); token r belongs to request r (a decode-only step)
    kv_cache:    (2, num_pages, page_size, KVH, D), dtype of q; H % KVH == 0
    seq_lens:    (R,) int32 (0 for padded requests); block_table: (R, MB) int32
    counts, indices: a ``BlockSparseLayout`` of the layer's heads, (H, NQB) and (H, NQB, W) int32
    partial_out: (>= R*H*S, D) float32; partial_ml: (>= R*H*S, 2) float32 (unused when S == 1)
    returns:     (R, H, D), dtype of q
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocksparse_prefill import check_paged_inputs
from .blocksparse_reduce import blocksparse_reduce


@triton.jit(do_not_specialize=["num_splits"])
def _blocksparse_decode_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_ml_ptr,
    seq_lens_ptr, block_table_ptr, counts_ptr, indices_ptr,
    # sizes
    num_q_blocks, num_splits, qk_scale,
    # strides
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv_page, stride_kv_tok, stride_kv_head,
    stride_bt_req, stride_counts_head, stride_idx_head, stride_idx_qb,
    # meta-parameters
    HEAD_DIM: tl.constexpr, QUERY_GROUP: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    seq_len = tl.load(seq_lens_ptr + req)
    qb = tl.minimum(tl.maximum(seq_len - 1, 0) // SPARSE_BLOCK, num_q_blocks - 1)
    count = tl.load(counts_ptr + head * stride_counts_head + qb)
    count = tl.where(seq_len > 0, count, 0)
    share = tl.cdiv(count, num_splits)
    first = split * share
    last = tl.minimum(first + share, count)
    idx_row = indices_ptr + head * stride_idx_head + qb * stride_idx_qb
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_off = (head // QUERY_GROUP) * stride_kv_head

    q = tl.load(q_ptr + req.to(tl.int64) * stride_q_tok + head * stride_q_head + offs_d).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for i in range(first * (SPARSE_BLOCK // BLOCK_N), last * (SPARSE_BLOCK // BLOCK_N)):
        kb = tl.load(idx_row + i // (SPARSE_BLOCK // BLOCK_N))
        start = kb * SPARSE_BLOCK + (i % (SPARSE_BLOCK // BLOCK_N)) * BLOCK_N
        kpos = start + offs_n
        k_ok = kpos < seq_len
        if PAGE_SIZE >= BLOCK_N:
            page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
            kv_addr = page * stride_kv_page + (start % PAGE_SIZE + offs_n) * stride_kv_tok + kv_off
        else:
            page = tl.load(bt_row + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_addr = page * stride_kv_page + (kpos % PAGE_SIZE) * stride_kv_tok + kv_off
        k = tl.load(k_cache_ptr + kv_addr[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        s = tl.sum(q[None, :] * k.to(tl.float32), 1) * qk_scale          # (BLOCK_N,), log2 domain
        s = tl.where(k_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        v = tl.load(v_cache_ptr + kv_addr[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new

    if num_splits == 1:
        out = tl.where(l_i > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        tl.store(out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
                 out.to(out_ptr.dtype.element_ty))
    else:
        part = (req.to(tl.int64) * tl.num_programs(0) + head) * num_splits + split
        tl.store(partial_out_ptr + part * HEAD_DIM + offs_d, acc)
        tl.store(partial_ml_ptr + part * 2, m_i)
        tl.store(partial_ml_ptr + part * 2 + 1, l_i)


def decode_num_splits(num_reqs: int, num_heads: int, layout_width: int, sparse_block_size: int, *,
                      target_programs: int = 1024, min_keys_per_split: int = 128, max_splits: int = 32) -> int:
    """KV splits per (request, head): a function of static sizes only (capture-safe).

    Enough programs to fill the GPU (``target_programs``), but no split shorter than
    ``min_keys_per_split`` keys of the widest layout row.
    """
    by_length = max(1, layout_width * sparse_block_size // min_keys_per_split)
    by_occupancy = max(1, -(-target_programs // max(1, num_reqs * num_heads)))
    return max(1, min(max_splits, by_length, by_occupancy))


def _launch_decode(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   counts: torch.Tensor, indices: torch.Tensor, partial_out: torch.Tensor,
                   partial_ml: torch.Tensor, sm_scale: float, sparse_block_size: int,
                   num_splits: int) -> torch.Tensor:
    check_paged_inputs(q, kv_cache, block_table, counts, indices, sparse_block_size)
    num_reqs, num_heads, head_dim = q.shape
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
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _blocksparse_decode_kernel[(num_heads, num_splits, num_reqs)](
        q, k_cache, v_cache, out, partial_out, partial_ml, seq_lens, block_table, counts, indices,
        counts.shape[1], num_splits, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), counts.stride(0), indices.stride(0), indices.stride(1),
        HEAD_DIM=head_dim, QUERY_GROUP=num_heads // num_kv_heads, SPARSE_BLOCK=sparse_block_size,
        PAGE_SIZE=page_size, BLOCK_N=min(sparse_block_size, 64),
        num_warps=4, num_stages=2 if q.is_cuda else 1)
    if num_splits > 1:
        blocksparse_reduce(partial_out[:rows].view(num_reqs, num_heads, num_splits, head_dim),
                           partial_ml[:rows].view(num_reqs, num_heads, num_splits, 2), out)
    return out


@torch.library.custom_op("fullgraph::blocksparse_decode", mutates_args=("partial_out", "partial_ml"))
def _blocksparse_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor,
                           partial_out: torch.Tensor, partial_ml: torch.Tensor, sm_scale: float,
                           sparse_block_size: int, num_splits: int) -> torch.Tensor:
    return _launch_decode(q, kv_cache, seq_lens, block_table, counts, indices, partial_out, partial_ml,
                          sm_scale, sparse_block_size, num_splits)


@_blocksparse_decode_op.register_fake
def _(q, kv_cache, seq_lens, block_table, counts, indices, partial_out, partial_ml, sm_scale,
      sparse_block_size, num_splits):
    return torch.empty_like(q)


def blocksparse_decode(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       counts: torch.Tensor, indices: torch.Tensor, partial_out: torch.Tensor,
                       partial_ml: torch.Tensor, *, sm_scale: float, sparse_block_size: int,
                       num_splits: int) -> torch.Tensor:
    """Block-sparse decode attention (see the module docstring for the layout contract).

    ``partial_out``/``partial_ml`` are persistent float32 workspaces owned by the caller (rows
    ``>= R * H * num_splits``); they are scratch, overwritten on every call. Capture-safe; runs as
    the ``torch.ops.fullgraph.blocksparse_decode`` custom op. Returns a new (R, H, D) tensor.
    """
    return torch.ops.fullgraph.blocksparse_decode(q, kv_cache, seq_lens, block_table, counts, indices,
                                                  partial_out, partial_ml, float(sm_scale),
                                                  int(sparse_block_size), int(num_splits))
