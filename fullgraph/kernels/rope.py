"""Rotary position embedding (rotate-half / NeoX) of q and k in one launch.

Algorithm, for each token t and head h (of q or of k), with half = D / 2 and i < half::

    c, s = cos[positions[t], i], sin[positions[t], i]          (float32 tables; mscale folded in)
    out[t, h, i]        = x[t, h, i] * c - x[t, h, i + half] * s
    out[t, h, i + half] = x[t, h, i + half] * c + x[t, h, i] * s

computed in float32, stored in x's dtype. One program handles one token: all its q heads, then
all its k heads, so the cos/sin row is read once per token.

Layout contract: q (T, H, D) or grouped (T, KVH, G, D) with H = KVH * G, k (T, KVH, D), unit
stride along D (token, group and head strides are free: views of a fused QKV projection work,
including head-major ones that interleave each group's query heads with its k and v);
positions (T,) int; cos, sin (P, D/2) float32. Returns new contiguous (T, H, D) and (T, KVH, D).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op


@triton.jit
def _rotate(x_ptr, out_ptr, row, num_heads, group, stride_t, stride_g, stride_h, c, s, live,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one row's heads into ``out``; a row that is not ``live`` (padding) reads nothing and
    gets zeros."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    read = (heads < tl.where(live, num_heads, 0)) & (cols < HALF)     # nothing, for a padded row
    src = x_ptr + row * stride_t + (heads // group) * stride_g + (heads % group) * stride_h + cols
    x1 = tl.load(src, mask=read, other=0.0)
    x2 = tl.load(src + HALF, mask=read, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + row * num_heads * (2 * HALF) + heads * (2 * HALF) + cols
    tl.store(dst, (x1f * c - x2f * s).to(x1.dtype), mask=mask)
    tl.store(dst + HALF, (x2f * c + x1f * s).to(x1.dtype), mask=mask)


@compile_ahead.kernel
@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,   # pointers
    num_q_heads, num_k_heads, q_group,                                 # sizes
    stride_qt, stride_qg, stride_qh, stride_kt, stride_kh,             # strides
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0)
    _rotate(q_ptr, q_out_ptr, row, num_q_heads, q_group, stride_qt, stride_qg, stride_qh, c, s, row >= 0,
            HALF, BLOCK_HQ, BLOCK_D)
    _rotate(k_ptr, k_out_ptr, row, num_k_heads, num_k_heads, stride_kt, 0, stride_kh, c, s, row >= 0,
            HALF, BLOCK_HK, BLOCK_D)


@triton.jit
def rope_rows(M, pos_ptr, slot_ptr, num_slots, BLOCK_M: tl.constexpr):
    """The first half of what the fused QKV projection's epilogue (``linear_rope_kv.rope_kv_epilogue``)
    reads besides the product: each of the BLOCK_M rows' position and slot (-1: padding, or past the
    ``num_slots`` of the mapping). Step metadata: the split-K kernel loads it right after its PDL
    wait, so its round trip overlaps the weight stream; the one-row kernel after the stream (there the
    early load took llama-1b's step longer)."""
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0).to(tl.int64)
    return pos, tl.load(slot_ptr + rm, mask=row_ok & (rm < num_slots), other=-1).to(tl.int64)


@triton.jit
def rope_tables(pid, M, pos, cos_ptr, sin_ptr, NUM_PAIRS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The second half: the cos / sin of each row's position at the index i of each of program
    ``pid``'s column pairs (``linear_rope_kv.pair_columns``), (BLOCK_M, BLOCK_N / 2) float32 each."""
    i = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    ok = (tl.arange(0, BLOCK_M) < M)[:, None] & (i < NUM_PAIRS)[None, :]
    table = pos[:, None] * HALF + (i % HALF)[None, :]
    return tl.load(cos_ptr + table, mask=ok, other=0.0), tl.load(sin_ptr + table, mask=ok, other=0.0)


@custom_op("fullgraph::rope", mutates_args=())
def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k); see the module docstring."""
    grouped = q.dim() == 4
    num_tokens, head_dim = q.shape[0], q.shape[-1]
    num_q_heads = q.shape[1] * q.shape[2] if grouped else q.shape[1]
    q_group = q.shape[2] if grouped else num_q_heads
    half = head_dim // 2
    if (q.stride(-1) != 1 or k.stride(-1) != 1 or k.shape[0] != num_tokens or k.shape[2] != head_dim
            or cos.shape[-1] != half or positions.shape != (num_tokens,)):
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}, "
                         f"cos {tuple(cos.shape)}: need (T, H, D) or (T, KVH, G, D), (T, KVH, D), (T,), (P, D/2), "
                         "unit stride on D")
    q_out = compile_ahead.output((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    k_out = compile_ahead.output((num_tokens, k.shape[1], head_dim), k.dtype, k.device)
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, positions, cos, sin, q_out, k_out, num_q_heads, k.shape[1], q_group,
            q.stride(0), q.stride(1) if grouped else 0, q.stride(-2), k.stride(0), k.stride(1),
            HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half), num_warps=4, **pdl.options(q))
    return q_out, k_out


@rope.register_fake
def _(q, k, positions, cos, sin):
    return (torch.empty((q.shape[0], q.shape[-3] * q.shape[-2] if q.dim() == 4 else q.shape[1], q.shape[-1]),
                        dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))
