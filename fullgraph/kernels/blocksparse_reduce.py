"""Merge the split-KV partial results of the block-sparse decode kernel.

Algorithm: split ``s`` of (request, head) left an unnormalised accumulator ``o_s``, its running
max ``m_s`` (log2 domain, -inf for an empty split) and sum ``l_s``. The output is
``sum_s w_s o_s / sum_s w_s l_s`` with ``w_s = exp2(m_s - max_s m_s)``; a row whose splits are all
empty (a padded request, seq_len 0) gets zeros, never NaN.

Tensor layout contract:
    partial_out: (R, H, S, D) float32, contiguous
    partial_ml:  (R, H, S, 2) float32, contiguous ([..., 0] = m, [..., 1] = l)
    out:         (R, H, D), last dim contiguous (written in full)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl

MIN_SPLITS_PAD = 16  # the split axis has at least this many lanes: one compiled variant up to 16 splits


@compile_ahead.kernel
@triton.jit(do_not_specialize=["num_splits"])
def _blocksparse_reduce_kernel(
    # pointers
    partial_out_ptr, partial_ml_ptr, out_ptr,
    # sizes
    num_splits,
    # strides
    stride_o_tok, stride_o_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr, SPLITS_POW2: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    head = tl.program_id(0)
    req = tl.program_id(1)
    row = req.to(tl.int64) * tl.num_programs(0) + head
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    part = row * num_splits + offs_s
    m = tl.load(partial_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(partial_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    o = tl.load(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))         # (S,)
    num = tl.sum(w[:, None] * o, 0)                                     # (D,)
    den = tl.sum(w * l, 0)
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def merge_split_rows(partial_out_ptr, partial_ml_ptr, out_row_ptr, first_part, head, row_ok, offs_d, num_splits,
                     stride_o_head, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The same merge for the rows of one decode program (its query heads ``head``, partial rows
    ``first_part + s``), inside the decode launch (its in-launch merge). Reads through L2 (``.cg``):
    the other splits wrote from other SMs."""
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for t in range(num_splits):
        top = tl.maximum(top, tl.load(partial_ml_ptr + (first_part + t) * 2, mask=row_ok, other=float("-inf"),
                                      cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    num = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(num_splits):
        m_t = tl.load(partial_ml_ptr + (first_part + t) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(m_t == float("-inf"), 0.0, tl.exp2(m_t - top))
        l_t = tl.load(partial_ml_ptr + (first_part + t) * 2 + 1, mask=w > 0.0, other=0.0, cache_modifier=".cg")
        o_t = tl.load(partial_out_ptr + (first_part + t)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=(w > 0.0)[:, None], other=0.0, cache_modifier=".cg")
        num += w[:, None] * o_t
        den += w * l_t
    out = tl.where(den[:, None] > 0.0, num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
    tl.store(out_row_ptr + head[:, None] * stride_o_head + offs_d[None, :], out.to(out_row_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def blocksparse_reduce(partial_out: torch.Tensor, partial_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``out`` (R, H, D) from the split partials (see the module docstring). Capture-safe."""
    num_reqs, num_heads, num_splits, head_dim = partial_out.shape
    if partial_ml.shape != (num_reqs, num_heads, num_splits, 2) or out.shape != (num_reqs, num_heads, head_dim):
        raise ValueError(f"partial_out {tuple(partial_out.shape)}, partial_ml {tuple(partial_ml.shape)} and "
                         f"out {tuple(out.shape)} do not agree on (R, H, S, D)")
    if not (partial_out.is_contiguous() and partial_ml.is_contiguous()) or out.stride(-1) != 1:
        raise ValueError("partial buffers must be contiguous and out's last dim contiguous")
    _blocksparse_reduce_kernel[(num_heads, num_reqs)](
        partial_out, partial_ml, out, num_splits,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_POW2=max(MIN_SPLITS_PAD, triton.next_power_of_2(num_splits)),
        num_warps=4 if head_dim >= 128 else 2, **pdl.options(out))
