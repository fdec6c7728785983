"""Merge the split-KV partial results of a decode step (the second pass of split-KV attention).

Algorithm: split s of request r produced a normalised partial output ``o_s`` and its log2-sum-exp
``lse_s`` (``-inf`` for an empty split). The merged row is ``sum_s w_s * o_s / sum_s w_s`` with
``w_s = exp2(lse_s - max_s lse_s)``; a request with no key at all (padding) gets zeros. One
program per (request, query head); NUM_SPLITS is a launch constant.

Layout contract (decode step: R == T, token r belongs to request r):
    part_out: flat float32, row ``(r * NUM_SPLITS + s) * H + h`` holds ``next_pow2(D)`` values
    part_lse: flat float32, the same rows, one value each
    out:      (T, H, D), any float dtype, ``stride(-1) == 1``; rows 0 .. R-1 are written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl


@compile_ahead.kernel
@triton.jit
def _split_kv_reduce_kernel(
        # pointers
        out_ptr, part_out_ptr, part_lse_ptr,
        # sizes
        num_heads,
        # strides (elements)
        stride_ot, stride_oh,
        # meta
        NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_PAD)
    first = (req * NUM_SPLITS * num_heads + head).to(tl.int64)       # row of split 0; split s adds s * H
    # One split at a time on one (D_PAD,) vector, each lse a scalar: no reduction across a tile
    # and no layout conversion, so no shared memory (a 2-D tile reduced over its splits went
    # through shared memory, where threads holding replicated values wrote the same words:
    # compute-sanitizer's racecheck reported it).
    top = tl.load(part_lse_ptr + first)
    for s in tl.static_range(1, NUM_SPLITS):
        top = tl.maximum(top, tl.load(part_lse_ptr + first + s * num_heads))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros((HEAD_DIM_PAD,), dtype=tl.float32)
    total = 0.0
    for s in tl.static_range(NUM_SPLITS):
        row = first + s * num_heads
        w = tl.math.exp2(tl.load(part_lse_ptr + row) - top)          # 0 for an empty split
        part = tl.load(part_out_ptr + row * HEAD_DIM_PAD + d, mask=d < tl.where(w > 0, HEAD_DIM_PAD, 0),
                       other=0.0)                                    # an empty split reads nothing
        acc += part * w
        total += w
    merged = acc / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_kv_reduce(*, out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                    num_splits: int) -> None:
    """Write ``out[r, h]`` for every request r < ``out.shape[0]`` from the split partials.

    Capture-safe: the grid is ``(T, H)`` and ``num_splits`` a launch constant.
    """
    num_tokens, num_heads, head_dim = out.shape
    head_dim_pad = triton.next_power_of_2(head_dim)
    rows = num_tokens * num_splits * num_heads
    if part_out.numel() < rows * head_dim_pad or part_lse.numel() < rows or out.stride(-1) != 1:
        raise ValueError(f"split_kv_reduce: out {tuple(out.shape)} stride {out.stride()} with {num_splits} "
                         f"splits needs {rows * head_dim_pad} / {rows} workspace elements, got "
                         f"{part_out.numel()} / {part_lse.numel()}")
    _split_kv_reduce_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse,
        num_heads,
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, num_warps=1 if head_dim_pad <= 64 else 2, **pdl.options(out))
