"""Each row's argmax of a (R, V) block of logits, in two launches: a decode loop's greedy pick
outside the graph (``sampling.greedy``).

``torch.argmax`` over V = 128,256 took 27 us a call at 1 and at 32 rows on an H100 (latency, not
bandwidth: 0.5 MB at one row), and the sampling kernel's greedy path five launches (12.7 / 19.1
us). Here the first launch splits each row into chunks, one program each, which store their
chunk's max and its first index; the second takes, per row, the largest of them and the lowest
index holding it. The rules are the sampling kernel's greedy ones: NaN counts as ``-inf``, ties go
to the lowest id, a row with nothing above ``-inf`` gives 0.

Layout contract: logits (R, V) float32 / bf16 / fp16 with unit column stride; returns (R,) int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .sampling_common import INT_MAX, NEG_INF, _chunk_max

BLOCK = 1024            # tokens a program reads per loop step
PROGRAMS_PER_SM = 4     # chunks over all rows, per SM


@compile_ahead.kernel
@triton.jit
def _chunk_max_kernel(x_ptr, part_f_ptr, part_i_ptr, vocab, chunk, num_chunks, stride_x,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    m, first = _chunk_max(x_ptr + row * stride_x, c, chunk, vocab, BLOCK)
    tl.store(part_f_ptr + row * num_chunks + c, m)
    tl.store(part_i_ptr + row * num_chunks + c, first)


@compile_ahead.kernel
@triton.jit
def _row_argmax_kernel(part_f_ptr, part_i_ptr, out_ptr, num_chunks, C_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    ok = c < num_chunks
    m = tl.load(part_f_ptr + row * num_chunks + c, mask=ok, other=NEG_INF)
    first = tl.load(part_i_ptr + row * num_chunks + c, mask=ok, other=INT_MAX)
    top = tl.max(m, 0)
    tl.store(out_ptr + row, tl.min(tl.where(m == top, first, INT_MAX), 0).to(tl.int64))


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def argmax(logits: torch.Tensor, *, num_chunks: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """(R,) int64: each row's argmax (NaN as -inf, ties -> lowest id, an all -inf row -> 0).
    ``num_chunks`` and ``block`` are tuning knobs (tests shrink them to cross chunk boundaries)."""
    rows, vocab = logits.shape
    out = compile_ahead.output(rows, torch.int64, logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    max_chunks = triton.cdiv(vocab, block)
    c = min(max_chunks, num_chunks or max(1, triton.cdiv(PROGRAMS_PER_SM * _sms(logits.device), rows)))
    chunk = triton.cdiv(triton.cdiv(vocab, c), block) * block
    c = triton.cdiv(vocab, chunk)
    part_f = torch.empty(rows, c, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows, c, dtype=torch.int32, device=logits.device)
    opts = pdl.options(logits)
    _chunk_max_kernel[(rows, c)](logits, part_f, part_i, vocab, chunk, c, logits.stride(0), BLOCK=block,
                                 num_warps=4, **opts)
    _row_argmax_kernel[(rows,)](part_f, part_i, out, c, C_PAD=triton.next_power_of_2(c), num_warps=4, **opts)
    return out
