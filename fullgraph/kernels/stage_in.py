"""A step's staged fields into their device buffers, read straight from pinned host memory.

The runner plans each step into one pinned host area (``StaticBuffers``) whose device twin the
graph reads. Sent with ``cudaMemcpyAsync`` in the step's stream, that copy is a copy-engine
operation between two kernels: on an H100 the device idled 5-6 us before it and again before the
kernel after it (``benchmarks/profile_loop.py``), and a decode loop that hands the previous step's
ids over on the device then clamped them into place with a kernel of its own. Here one kernel
does both: its programs read the host area over the bus (pinned memory is mapped into the GPU's
address space) and write the device buffer, and the last programs write the handed-over ids,
clamped into ``[0, hi]``, over the staged ones.

Layout contract: ``src`` (pinned host) and ``dst`` (device) int32 words, ``n_words`` each;
``ids`` (n,) int64 or int32 on the device and ``ids_dst`` a view of ``dst`` (words ``[skip_lo,
skip_hi)``) that takes them; with no ids, ``n_ids = 0`` and the skipped range is empty. A launch
sees the bytes the host wrote before it (mapped pinned memory; the GPU test rewrites the area
between launches); the loads also ask not to be cached (``.cv``: Triton 3.9 emits it, 3.6 drops it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words a program copies


@triton.jit(do_not_specialize=["n_words", "n_ids", "skip_lo", "skip_hi", "hi"])
def _stage_in_kernel(src_ptr, dst_ptr, n_words, ids_ptr, ids_dst_ptr, n_ids, skip_lo, skip_hi, hi,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    copies = tl.cdiv(n_words, BLOCK)
    if pid < copies:
        w = pid * BLOCK + tl.arange(0, BLOCK)
        ok = (w < n_words) & ((w < skip_lo) | (w >= skip_hi))
        tl.store(dst_ptr + w, tl.load(src_ptr + w, mask=ok, cache_modifier=".cv"), mask=ok)
    else:
        t = (pid - copies) * BLOCK + tl.arange(0, BLOCK)
        ok = t < n_ids
        tok = tl.load(ids_ptr + t, mask=ok, other=0).to(tl.int64)
        tok = tl.minimum(tl.maximum(tok, 0), hi)
        tl.store(ids_dst_ptr + t, tok.to(ids_dst_ptr.dtype.element_ty), mask=ok)


def stage_in(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor | None = None,
             ids_dst: torch.Tensor | None = None, hi: int | None = None, *, block: int = BLOCK) -> None:
    """``dst[:] = src`` (int32 words; ``src`` may be pinned host memory), then, given ``ids``,
    ``ids_dst[:len(ids)] = clamp(ids, 0, hi)`` (``ids_dst`` a view into ``dst``; ``hi`` None:
    2**31 - 1). One launch on the current stream; ``block`` (words a program copies) is a knob
    tests shrink to cross program boundaries.

    Pass ``ids_dst`` in every call, ids or not, and ids of one dtype: the kernel's pointer and
    integer argument types then stay the same, and so does its one compiled variant."""
    n_words = src.numel()
    if dst.numel() != n_words or src.dtype != torch.int32 or dst.dtype != torch.int32:
        raise ValueError(f"stage_in: src and dst must be int32 words of one size, got {src.dtype} {src.numel()} "
                         f"and {dst.dtype} {dst.numel()}")
    hi = 2**31 - 1 if hi is None else hi
    if not 0 <= hi < 2**31:
        raise ValueError(f"stage_in: hi = {hi}: expected an id bound in [0, 2**31)")
    n_ids, skip_lo, skip_hi = 0, 0, 0
    if ids is not None and len(ids):
        n_ids = len(ids)
        if ids_dst is None or ids_dst.numel() < n_ids or not ids_dst.is_contiguous():
            raise ValueError(f"stage_in: {n_ids} ids need a contiguous destination of at least that many elements")
        skip_lo = (ids_dst.data_ptr() - dst.data_ptr()) // 4
        skip_hi = skip_lo + -(-n_ids * ids_dst.element_size() // 4)
        if skip_lo < 0 or skip_hi > n_words:
            raise ValueError("stage_in: ids_dst must lie inside dst")
        ids = ids.contiguous()   # the kernel reads them at unit stride
    else:  # unread (no program takes the ids branch); the same argument types as a step with ids
        ids_dst = dst if ids_dst is None else ids_dst
        ids = ids_dst
    grid = (triton.cdiv(n_words, block) + triton.cdiv(n_ids, block),)
    _stage_in_kernel[grid](src, dst, n_words, ids, ids_dst, n_ids, skip_lo, skip_hi, hi, BLOCK=block, num_warps=4)
