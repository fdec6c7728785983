"""RoPE fused into the KV-cache write: rotate q, and store rotated k and v in the paged cache.

One launch where ``rope`` then ``kv_write`` take two. Attention reads every key, the step's new
ones included, from the cache, so the rotated keys never need to exist as a tensor.

Algorithm: one program per token t < T = ``query.shape[0]``. It reads the cos/sin row of
``positions[t]`` once and rotates all of t's query heads into ``q_out[t]`` exactly as ``rope``
does (rotate-half, float32 math, stored in q's dtype). Then, if t < S = ``slot_mapping.shape[0]``
and ``slot = slot_mapping[t] >= 0``, it rotates t's key heads and stores them, with its unrotated
value heads, at page ``slot // PAGE_SIZE``, offset ``slot % PAGE_SIZE``, in the cache dtype. A
token with a negative slot is padding: it reads no q, key or value row, its ``q_out`` row is
zeros, and it touches no cache byte (the write count comes from the slot mapping, as in
``kv_write``). A token past the slot mapping (t >= S) is rotated but writes nothing.

Layout contract:
    query:        (T, H, D) or head-major grouped (T, KVH, G, D) with H = KVH * G; ``stride(-1) == 1``
                  (token, group and head strides are free: views of a fused QKV projection work)
    key, value:   (>= S, KVH, D), ``stride(-1) == 1``
    kv_cache:     (2, num_blocks, PAGE_SIZE, KVH, D), ``stride(-1) == 1``; [0] keys, [1] values
    slot_mapping: (S,) int64 with S <= T, ``block_id * PAGE_SIZE + offset`` or -1 (write nothing)
    positions:    (T,) int; cos, sin: (P, D/2) float32, contiguous (any mscale folded in)
Returns q_out, a new contiguous (T, H, D) tensor in q's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .rope import _rotate
from .._compat import custom_op


@compile_ahead.kernel
@triton.jit
def _rope_kv_write_kernel(
        # pointers
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, kv_ptr,
        # sizes
        num_slots, num_q_heads, num_kv_heads, q_group,
        # strides (elements)
        stride_qt, stride_qg, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kv, stride_cb, stride_cs, stride_ch,
        # meta
        PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
        BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0)
    # a padded token (slot -1) reads no q row and gets a zero q_out row (defined, never stale)
    _rotate(q_ptr, q_out_ptr, tok, num_q_heads, q_group, stride_qt, stride_qg, stride_qh, c, s,
            (slot >= 0) | (tok >= num_slots), HALF, BLOCK_HQ, BLOCK_D)
    if slot >= 0:  # padding (or a token past the slot mapping) reads no k/v row, writes no cache byte
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = (heads < num_kv_heads) & (cols < HALF)
        k_src = k_ptr + tok * stride_kt + heads * stride_kh + cols
        v_src = v_ptr + tok * stride_vt + heads * stride_vh + cols
        k1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        dst = kv_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + heads * stride_ch + cols
        ty = kv_ptr.dtype.element_ty
        tl.store(dst, (k1 * c - k2 * s).to(ty), mask=mask)
        tl.store(dst + HALF, (k2 * c + k1 * s).to(ty), mask=mask)
        tl.store(dst + stride_kv, v1.to(ty), mask=mask)
        tl.store(dst + stride_kv + HALF, v2.to(ty), mask=mask)


@custom_op("fullgraph::rope_kv_write", mutates_args=("kv_cache",))
def _rope_kv_write_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    grouped = query.dim() == 4
    num_tokens, head_dim = query.shape[0], query.shape[-1]
    num_q_heads = query.shape[1] * query.shape[2] if grouped else query.shape[1]
    q_out = compile_ahead.output((num_tokens, num_q_heads, head_dim), query.dtype, query.device)
    if num_tokens == 0:
        return q_out
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    half = head_dim // 2
    _rope_kv_write_kernel[(num_tokens,)](
        query, key, value, positions, cos, sin, slot_mapping, q_out, kv_cache,
        slot_mapping.shape[0], num_q_heads, num_kv_heads, query.shape[2] if grouped else num_q_heads,
        query.stride(0), query.stride(1) if grouped else 0, query.stride(-2),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        PAGE_SIZE=page_size, HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(half), num_warps=4,
        **pdl.options(query))
    return q_out


@_rope_kv_write_op.register_fake
def _(query, key, value, kv_cache, slot_mapping, positions, cos, sin):
    num_q_heads = query.shape[1] * query.shape[2] if query.dim() == 4 else query.shape[1]
    return query.new_empty((query.shape[0], num_q_heads, query.shape[-1]))


def _check(query, key, value, kv_cache, slot_mapping, positions, cos, sin) -> None:
    num_tokens, head_dim = query.shape[0], query.shape[-1]
    kv_shape = tuple(kv_cache.shape[3:]) if kv_cache.dim() == 5 else None
    if (query.dim() not in (3, 4) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or key.dim() != 3
            or key.shape != value.shape or tuple(key.shape[1:]) != kv_shape or kv_shape[1] != head_dim
            or head_dim % 2 or (query.dim() == 4 and query.shape[1] != kv_shape[0])):
        raise ValueError(f"rope_kv_write: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}, kv_cache {tuple(kv_cache.shape)}: need query (T, H, D) or "
                         "(T, KVH, G, D), key = value (>= S, KVH, D), kv_cache (2, NB, page, KVH, D), D even")
    num_slots = slot_mapping.shape[0]
    if (slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or num_slots > num_tokens
            or key.shape[0] < num_slots or positions.shape != (num_tokens,)):
        raise ValueError(f"rope_kv_write: slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} must be "
                         f"(S,) int64 with S <= T = {num_tokens} and S <= key rows {key.shape[0]}; positions "
                         f"{tuple(positions.shape)} must be (T,)")
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2 or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"rope_kv_write: cos {tuple(cos.shape)} {cos.dtype} / sin {tuple(sin.shape)} {sin.dtype} "
                         f"must be contiguous (P, {head_dim // 2}) float32")
    if any(t.stride(-1) != 1 for t in (query, key, value, kv_cache)):
        raise ValueError(f"rope_kv_write: query/key/value/kv_cache need unit stride on D, got strides "
                         f"{query.stride()}, {key.stride()}, {value.stride()}, {kv_cache.stride()}")


def rope_kv_write(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Rotated query (T, H, D); rotated ``key[t]`` and ``value[t]`` written at ``slot_mapping[t]``
    for every t with a slot >= 0 (in place). See the module docstring for the contract.

    Capture-safe: the grid is ``query.shape[0]``; skipped tokens are decided on the device.
    """
    _check(query, key, value, kv_cache, slot_mapping, positions, cos, sin)
    return _rope_kv_write_op(query, key, value, kv_cache, slot_mapping, positions, cos, sin)
