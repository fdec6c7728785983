"""Split-KV decode: how many splits a step takes, and merging their partial results (the second
pass of split-KV attention, as a launch of its own or inside the attention launch).

Algorithm: split s of request r produced a normalised partial output ``o_s`` and its log2-sum-exp
``lse_s`` (``-inf`` for an empty split). The merged row is ``sum_s w_s * o_s / sum_s w_s`` with
``w_s = exp2(lse_s - max_s lse_s)``; a request with no key at all (padding) gets zeros. One
program per (request, query head); NUM_SPLITS is a launch constant.

Layout contract (decode step: R == T, token r belongs to request r):
    part_out: flat float32, row ``(r * NUM_SPLITS + s) * H + h`` holds ``next_pow2(D)`` values
    part_lse: flat float32, the same rows, one value each
    out:      (T, H, D), any float dtype, ``stride(-1) == 1``; rows 0 .. R-1 are written.

``merge_splits`` is the same merge over the rows of one attention program, for the attention
kernel's in-launch merge (``paged_attention``'s MERGE).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 64  # never split a sequence into pieces shorter than this (at max_model_len)
SPLIT_PROGRAMS_PER_SM = 4  # split decode until about this many programs per SM are in flight ...
UNSPLIT_PROGRAMS_PER_SM = 1  # ... unless one program per (request, KV head) already puts this many on every SM


def num_kv_splits(num_reqs: int, num_kv_heads: int, max_model_len: int, num_sms: int) -> int:
    """Splits per sequence of a decode step, enough for ``SPLIT_PROGRAMS_PER_SM`` programs per SM;
    none once the step's (request, KV head) programs fill every SM (``UNSPLIT_PROGRAMS_PER_SM``),
    which spares the reduce launch. On H100s (2026-12-06, llama-1b / SmolLM2, batches 1-64) this
    rule and splitting to one, two or four programs an SM at every batch gave the same step times
    within 0.7% (contexts 1024 and 4096).

    Static inputs only (R is the padded request count, never a ``seq_lens`` value), so a graph
    replays the split count it was captured with, whatever the lengths of the replayed step."""
    programs = num_reqs * num_kv_heads
    if programs >= UNSPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    by_len = max(1, max_model_len // MIN_SPLIT_TOKENS)
    return max(1, min(-(-(SPLIT_PROGRAMS_PER_SM * num_sms) // programs), by_len, MAX_SPLITS))


def split_workspace_rows(max_num_seqs: int, num_kv_heads: int, max_model_len: int, num_sms: int) -> int:
    """Largest R * NUM_SPLITS over R <= max_num_seqs: the rows a persistent workspace needs."""
    return max(r * num_kv_splits(r, num_kv_heads, max_model_len, num_sms) for r in range(1, max_num_seqs + 1))



@triton.jit
def merge_splits(out_ptr, part_out_ptr, part_lse_ptr, req, tok, head, row_ok, d, num_heads, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """The reduce of ``split_kv_reduce`` over one program's rows. Reads through L2 (``.cg``): the
    other splits wrote from other SMs. The rows' log-sum-exps of every split are one (BLOCK_M,
    splits) load; the partial outputs come CHUNK splits at a time, as (BLOCK_M, CHUNK, D) loads,
    so a merge of S splits waits for 1 + S / CHUNK round trips to L2, not 2 S (a split at a time).
    The weighted sum runs in another order than ``split_kv_reduce``'s (within float32 rounding)."""
    first = (req * NUM_SPLITS * num_heads + head).to(tl.int64)      # (BLOCK_M,) row of split 0
    s = tl.arange(0, CHUNK)
    every = tl.arange(0, SPLITS_PAD)                                # next_pow2(NUM_SPLITS)
    lse = tl.load(part_lse_ptr + first[:, None] + (every * num_heads)[None, :],
                  mask=row_ok[:, None] & (every < NUM_SPLITS)[None, :], other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.math.exp2(lse - top[:, None]), 1)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK):
        rows = first[:, None] + ((s0 + s) * num_heads)[None, :]                       # (BLOCK_M, CHUNK)
        w = tl.math.exp2(tl.load(part_lse_ptr + rows, mask=row_ok[:, None] & (s0 + s < NUM_SPLITS)[None, :],
                                 other=float("-inf"), cache_modifier=".cg") - top[:, None])
        part = tl.load(part_out_ptr + rows[:, :, None] * HEAD_DIM_PAD + d[None, None, :], mask=(w > 0)[:, :, None],
                       other=0.0, cache_modifier=".cg")                              # an empty split reads nothing
        acc += tl.sum(part * w[:, :, None], 1)
    merged = acc / tl.where(total > 0, total, 1.0)[:, None]
    o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


def merge_chunk(num_splits: int, block_m: int, head_dim_pad: int, num_warps: int) -> int:
    """Splits a merging program loads at once: a power of two, at most 32 float32 values a thread."""
    chunk = 1
    while chunk < num_splits and 2 * chunk * block_m * head_dim_pad <= 32 * 32 * num_warps:
        chunk *= 2
    return chunk


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
