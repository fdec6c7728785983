"""A step's staged fields into their device buffers, read straight from pinned host memory, as the
first kernel of the step's own CUDA graph.

The runner plans each step into one pinned host area (``StaticBuffers``) whose device twin the
graph reads. Sent with ``cudaMemcpyAsync`` in the step's stream, that copy is a copy-engine
operation between two kernels: on an H100 the device idled 5-6 us before it and again before the
kernel after it (``benchmarks/profile_loop.py``). Launched as a kernel of its own before the
graph, the copy cost the host a Triton launch every step (25-30 us more than the copy, H100).
Here the kernel is captured into every graph as its first node: its programs read the host area
over the bus (pinned memory is mapped into the GPU's address space) when the replay reaches them,
and the host launches nothing but the graph.

Layout contract: ``src`` (pinned host) and ``dst`` (device) are ``n_words`` int32 words each, the
last two of them control words the host writes every step: the copy skips the words
``[src[-2], src[-1])``, which the step's handed-over ids (written on the device before the graph)
occupy; ``(0, 0)`` skips nothing. A replay sees the bytes the host wrote before it (mapped pinned
memory; the GPU test rewrites the area between launches); the loads also ask not to be cached
(``.cv``: Triton 3.9 emits it, 3.6 drops it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024      # words a program copies
CONTROL = 2       # control words at the end of an area: the skipped range [lo, hi)


@triton.jit
def _stage_in_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    skip_lo = tl.load(src_ptr + n_words - 2, cache_modifier=".cv")
    skip_hi = tl.load(src_ptr + n_words - 1, cache_modifier=".cv")
    inside = w < n_words
    words = tl.load(src_ptr + w, mask=inside, cache_modifier=".cv")
    tl.store(dst_ptr + w, words, mask=inside & ((w < skip_lo) | (w >= skip_hi)))


def stage_in(src: torch.Tensor, dst: torch.Tensor, *, block: int = BLOCK) -> None:
    """``dst[w] = src[w]`` for every int32 word ``w`` outside ``[src[-2], src[-1])`` (``src`` may
    be pinned host memory; its last two words are read when the kernel runs, so a captured launch
    takes each replay's range). One launch on the current stream; ``block`` (words a program
    copies) is a knob tests shrink to cross program boundaries."""
    n_words = src.numel()
    if dst.numel() != n_words or src.dtype != torch.int32 or dst.dtype != torch.int32 or n_words < CONTROL:
        raise ValueError(f"stage_in: src and dst must be int32 areas of one size, with {CONTROL} control words at "
                         f"the end; got {src.dtype} {src.numel()} and {dst.dtype} {dst.numel()}")
    _stage_in_kernel[(triton.cdiv(n_words, block),)](src, dst, n_words, BLOCK=block, num_warps=4)
