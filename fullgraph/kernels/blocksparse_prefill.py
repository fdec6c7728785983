"""Block-sparse prefill attention over a paged KV cache (Phi-3-Small's local + vertical pattern).

Algorithm: FlashAttention-2 (online softmax, fp32 accumulators) where each query tile iterates
only over the key blocks its sparse row keeps. Query tiles are aligned to ABSOLUTE positions:
tile ``qt`` covers positions ``[qt*BLOCK_M, (qt+1)*BLOCK_M)`` intersected with the request's chunk,
and ``BLOCK_M`` divides the sparse block size, so a tile never straddles two sparse rows even when
a chunk starts mid-block (chunked prefill, prefix context). The kept blocks strictly before the
query block need no mask; the diagonal block (the row's last entry) is masked causally and against
``seq_len``, and its keys past the tile's last query are never visited.

Capture-safe: the grid comes from static sizes only, ``(H, T // BLOCK_M + 2 * R)``. Request r owns
the "virtual" tiles ``[qsl[r] // BLOCK_M + 2r, qsl[r+1] // BLOCK_M + 2(r+1))`` (at least
``cdiv(q_len, BLOCK_M) + 1`` of them, enough for a misaligned chunk); each program binary-searches
``query_start_loc`` for its request and exits early when its tile is idle. Every program also
zeroes the padded tokens (``t >= query_start_loc[R]``) of token range ``[tile*BLOCK_M, +BLOCK_M)``,
so every output row is written.

Tensor layout contract:
    q:               (T, H, D) fp16/bf16/fp32, last dim contiguous; D a power of two >= 16
    kv_cache:        (2, num_pages, page_size, KVH, D), same dtype as q; H % KVH == 0
    query_start_loc: (R + 1,) int32, non-decreasing, padded tail repeats the last real value
    seq_lens:        (R,) int32; request r's new tokens sit at positions seq_len - q_len ..
    block_table:     (R, MB) int32 page ids (KV already written for every position < seq_len)
    counts, indices: (H, NQB) and (H, NQB, W) int32, a ``BlockSparseLayout`` of the layer's heads
    returns:         (T, H, D), dtype of q
``page_size`` and ``sparse_block_size`` must nest (one divides the other).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_M: tl.constexpr):
    """Largest r in [0, num_reqs) with query_start_loc[r] // BLOCK_M + 2 * r <= tile."""
    left = tile * 0
    right = left + num_reqs
    while left < right:
        mid = (left + right) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_M + 2 * mid
        if first <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_tile(acc, m_i, l_i, q, pos, k_cache_ptr, v_cache_ptr, block_table_row, kv_off, start, seq_len,
                 qk_scale, stride_kv_page, stride_kv_tok,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One BLOCK_N-key step of the online softmax; keys ``start + [0, BLOCK_N)``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kpos = start + offs_n
    k_ok = kpos < seq_len
    if PAGE_SIZE >= BLOCK_N:   # the whole key tile lies in one page
        page = tl.load(block_table_row + start // PAGE_SIZE).to(tl.int64)
        kv_addr = page * stride_kv_page + (start % PAGE_SIZE + offs_n) * stride_kv_tok + kv_off
    else:                      # a page per token (pages smaller than the tile)
        page = tl.load(block_table_row + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_addr = page * stride_kv_page + (kpos % PAGE_SIZE) * stride_kv_tok + kv_off
    if MASKED:
        k = tl.load(k_cache_ptr + kv_addr[None, :] + offs_d[:, None], mask=k_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_addr[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_addr[None, :] + offs_d[:, None])            # (D, BLOCK_N)
        v = tl.load(v_cache_ptr + kv_addr[:, None] + offs_d[None, :])            # (BLOCK_N, D)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale                   # (BLOCK_M, BLOCK_N)
    if MASKED:
        s = tl.where((kpos[None, :] <= pos[:, None]) & k_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a fully masked row stays 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@compile_ahead.kernel
@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _blocksparse_prefill_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, counts_ptr, indices_ptr,
    # sizes
    num_reqs, num_tokens, num_q_blocks, qk_scale,
    # strides
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv_page, stride_kv_tok, stride_kv_head,
    stride_bt_req, stride_counts_head, stride_idx_head, stride_idx_qb,
    # meta-parameters
    HEAD_DIM: tl.constexpr, QUERY_GROUP: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    head = tl.program_id(0)
    tile = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    # Padded tokens of this token range get zeros, so every output row is written.
    pad_tok = tile.to(tl.int64) * BLOCK_M + offs_m
    pad = (pad_tok >= tl.load(query_start_loc_ptr + num_reqs)) & (pad_tok < num_tokens)
    tl.store(out_ptr + pad_tok[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
             tl.zeros((BLOCK_M, HEAD_DIM), out_ptr.dtype.element_ty), mask=pad[:, None])

    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len                      # absolute position of the chunk's first token
    qt = ctx_len // BLOCK_M + tile - (q_start // BLOCK_M + 2 * req)   # absolute query tile
    if (q_len <= 0) | (qt * BLOCK_M >= seq_len):
        return

    pos = qt * BLOCK_M + offs_m                    # absolute positions of the tile's rows
    row_ok = (pos >= ctx_len) & (pos < seq_len)
    tok = (q_start + pos - ctx_len).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)   # (BLOCK_M, D)

    qb = tl.minimum((qt * BLOCK_M) // SPARSE_BLOCK, num_q_blocks - 1)
    count = tl.load(counts_ptr + head * stride_counts_head + qb)
    idx_row = indices_ptr + head * stride_idx_head + qb * stride_idx_qb
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_off = (head // QUERY_GROUP) * stride_kv_head

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # Kept blocks before the diagonal: every key precedes every row and lies inside the sequence.
    # One flat loop over (kept block, key tile) pairs pipelines better than a nested one.
    for i in range((count - 1) * (SPARSE_BLOCK // BLOCK_N)):
        kb = tl.load(idx_row + i // (SPARSE_BLOCK // BLOCK_N))
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                                     kb * SPARSE_BLOCK + (i % (SPARSE_BLOCK // BLOCK_N)) * BLOCK_N, seq_len, qk_scale,
                                     stride_kv_page, stride_kv_tok,
                                     HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
    # The diagonal block qb (always the row's last entry): only keys up to the tile's last row.
    key_end = tl.minimum((qt + 1) * BLOCK_M, seq_len)
    for start in range(qb * SPARSE_BLOCK, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                                     start, seq_len, qk_scale, stride_kv_page, stride_kv_tok,
                                     HEAD_DIM, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       counts: torch.Tensor, indices: torch.Tensor, sparse_block_size: int,
                       per_kv_head: bool = False) -> None:
    """Shape/dtype/device checks shared by the prefill and decode launchers (static facts only).
    The layout has a row per query head, or per KV head with ``per_kv_head`` (the group layout)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected q (T, H, D) and kv_cache (2, pages, page_size, KVH, D), got "
                         f"q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}")
    _, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or q.dtype != kv_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match kv_cache {tuple(kv_cache.shape)} "
                         f"{kv_cache.dtype} (same head_dim and dtype, H a multiple of KVH)")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"block-sparse kernels need a power-of-two head_dim >= 16, got {head_dim}")
    if sparse_block_size < 16 or sparse_block_size & (sparse_block_size - 1):
        raise ValueError(f"block-sparse kernels need a power-of-two sparse block >= 16, got {sparse_block_size}")
    if sparse_block_size % page_size and page_size % sparse_block_size:
        raise ValueError(f"KV page size {page_size} and sparse block size {sparse_block_size} must nest "
                         "(one must divide the other)")
    rows, what = (num_kv_heads, "KV heads (a BlockSparseGroupLayout)") if per_kv_head else (num_heads, "heads")
    if counts.shape[0] != rows or indices.shape[:2] != counts.shape or \
            counts.dtype != torch.int32 or indices.dtype != torch.int32:
        raise ValueError(f"layout counts {tuple(counts.shape)} / indices {tuple(indices.shape)} do not "
                         f"match {rows} {what}, int32")
    tensors = {"kv_cache": kv_cache, "block_table": block_table, "counts": counts, "indices": indices}
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or not counts.is_contiguous() or not indices.is_contiguous():
        raise ValueError("q and kv_cache need a contiguous last dim, the layout contiguous tensors")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision dots; 16-bit inputs keep the default (tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_prefill(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, counts: torch.Tensor,
                    indices: torch.Tensor, sm_scale: float, sparse_block_size: int) -> torch.Tensor:
    check_paged_inputs(q, kv_cache, block_table, counts, indices, sparse_block_size)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    block = min(sparse_block_size, 64)
    out = compile_ahead.output(q.shape, q.dtype, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_heads, num_tokens // block + 2 * num_reqs)
    if grid[1] > 65535:
        raise ValueError(f"blocksparse prefill: {grid[1]} query tiles exceed CUDA's grid limit 65535 "
                         f"({num_tokens} tokens, {num_reqs} requests, tile {block})")
    _blocksparse_prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, counts, indices,
        num_reqs, num_tokens, counts.shape[1], sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), counts.stride(0), indices.stride(0), indices.stride(1),
        HEAD_DIM=head_dim, QUERY_GROUP=num_heads // num_kv_heads, SPARSE_BLOCK=sparse_block_size,
        PAGE_SIZE=page_size, BLOCK_M=block, BLOCK_N=block, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=3 if q.is_cuda else 1, **pdl.options(q))
    return out


@custom_op("fullgraph::blocksparse_prefill", mutates_args=())
def _blocksparse_prefill_op(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_table: torch.Tensor, counts: torch.Tensor,
                            indices: torch.Tensor, sm_scale: float, sparse_block_size: int) -> torch.Tensor:
    return _launch_prefill(q, kv_cache, query_start_loc, seq_lens, block_table, counts, indices,
                           sm_scale, sparse_block_size)


@_blocksparse_prefill_op.register_fake
def _(q, kv_cache, query_start_loc, seq_lens, block_table, counts, indices, sm_scale, sparse_block_size):
    return torch.empty_like(q)


def blocksparse_prefill(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, counts: torch.Tensor,
                        indices: torch.Tensor, *, sm_scale: float, sparse_block_size: int) -> torch.Tensor:
    """Block-sparse causal attention of packed new tokens over their paged sequences.

    See the module docstring for the layout contract. Capture-safe (no host syncs, static grid);
    runs as the ``fullgraph::blocksparse_prefill`` custom op, so ``torch.compile``
    traces through it. Returns a new (T, H, D) tensor; padded token rows are zeros.
    """
    return _blocksparse_prefill_op(q, kv_cache, query_start_loc, seq_lens, block_table,
                                                   counts, indices, float(sm_scale), int(sparse_block_size))
