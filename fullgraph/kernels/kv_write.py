"""Write a step's new keys and values into the paged KV cache at their slots.

Algorithm: one program per token t < ``slot_mapping.shape[0]``. It reads ``slot = slot_mapping[t]``;
a negative slot (padding) returns before touching memory, so those cache bytes stay identical.
Otherwise it copies the token's (KVH, D) key and value rows to page ``slot // PAGE_SIZE``, offset
``slot % PAGE_SIZE``. The token count comes from the slot mapping, never from the key tensor,
which may be longer (padded) than the tokens to write.

Layout contract:
    key, value:   (>= T, KVH, D), any strides with ``stride(-1) == 1`` (e.g. views of a fused
                  qkv projection); cast to the cache dtype on store
    kv_cache:     (2, num_blocks, PAGE_SIZE, KVH, D), ``stride(-1) == 1``; [0] keys, [1] values
    slot_mapping: (T,) int64, ``block_id * PAGE_SIZE + offset`` or -1 (write nothing)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op


@compile_ahead.kernel
@triton.jit
def _kv_write_kernel(
        # pointers
        kv_ptr, key_ptr, value_ptr, slot_mapping_ptr,
        # sizes
        num_kv_heads,
        # strides (elements)
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kv, stride_cb, stride_cs, stride_ch,
        # meta
        PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    value = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = kv_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs \
        + h[:, None] * stride_ch + d[None, :]
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


@custom_op("fullgraph::kv_write", mutates_args=("kv_cache",))
def _kv_write_op(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    heads_pad, head_dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _kv_write_kernel[(num_tokens,)](
        kv_cache, key, value, slot_mapping,
        num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEADS_PAD=heads_pad,
        num_warps=4 if heads_pad * head_dim_pad >= 1024 else 1, **pdl.options(key))


@_kv_write_op.register_fake
def _(key, value, kv_cache, slot_mapping) -> None:
    return None


def kv_write(*, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key[t]``/``value[t]`` at ``slot_mapping[t]`` for every t with a slot >= 0 (in place).

    Capture-safe: the grid is ``slot_mapping.shape[0]`` and skipped tokens are decided on the device.
    """
    t = slot_mapping.shape[0]
    if (key.dim() != 3 or key.shape != value.shape or key.shape[0] < t or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(key.shape[1:])):
        raise ValueError(f"kv_write: key {tuple(key.shape)} / value {tuple(value.shape)} must be (>= T, KVH, D) "
                         f"matching kv_cache (2, NB, page, KVH, D) = {tuple(kv_cache.shape)}, T = {t}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_write: slot_mapping must be (T,) int64 (got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}); kv_cache stride {kv_cache.stride()} must end in 1")
    _kv_write_op(key, value, kv_cache, slot_mapping)

