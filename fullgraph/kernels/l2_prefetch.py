"""Pull the head of a tensor into the GPU's L2 cache without reading it into registers.

A batch-1 decode step alternates weight-bound GEMMs (HBM busy) with chains of small
latency-bound kernels (norms, RoPE + KV write, attention, split-KV merge, activations) during
which HBM is idle. Launched on a side stream right after one GEMM, this kernel fetches the
next GEMM's weights into L2 while the small kernels run, so that GEMM then reads (part of)
them from L2.

Algorithm: the byte range is cut into ``CHUNK``-byte pieces; each lane of each program issues
one ``cp.async.bulk.prefetch.L2.global`` (the Hopper TMA engine's L2 prefetch; asynchronous,
no registers, no result) per piece. It is a hint: it changes no value anywhere, so the only
contract is the pointer (16-byte aligned) and the byte count (a multiple of 16).
Needs sm_90 or newer; ``supported`` says whether a device has it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384         # bytes per prefetch instruction
LANES = 32            # one warp per program, one chunk per lane per iteration
PROGRAMS = 16         # enough: the instructions are fire-and-forget


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    num_chunks = tl.cdiv(nbytes, CHUNK)
    base = ptr.to(tl.pointer_type(tl.int8))
    for start in range(pid * LANES, num_chunks, nprog * LANES):
        idx = (start + tl.arange(0, LANES)).to(tl.int64)
        size = tl.where(idx < num_chunks, tl.minimum(nbytes - idx * CHUNK, CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + idx * CHUNK, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(device: torch.device) -> bool:
    """The bulk L2 prefetch needs a CUDA device of compute capability 9.0 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch(t: torch.Tensor, max_bytes: int) -> None:
    """Start fetching the first ``min(t.nbytes, max_bytes)`` bytes of contiguous ``t`` into L2 on
    the current stream; returns at once (the loads complete asynchronously)."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"l2_prefetch: needs a contiguous, 16-byte aligned tensor (got strides {t.stride()})")
    nbytes = min(t.numel() * t.element_size(), max_bytes) // 16 * 16
    if nbytes > 0:
        _l2_prefetch_kernel[(PROGRAMS,)](t, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
