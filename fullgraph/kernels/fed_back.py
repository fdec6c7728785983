"""A step's input ids with the previous step's samples fed back, in one launch.

A sampling runner's decode token whose ``prev_token_row`` is ``j >= 0`` takes the id the previous
step sampled for row ``j`` (``feedback[j]``, on the device); the others keep their staged id::

    ids[t] = feedback[prev_token_row[t]] if prev_token_row[t] >= 0 else input_ids[t]

As PyTorch operators that is four kernels in every step's graph (a comparison, a clamp, a gather,
a select), each a launch of its own; here one program per BLOCK tokens.

Layout contract: input_ids, prev_token_row (T,) int64 contiguous; feedback (R,) int64, R >= 1;
returns a new (T,) int64 tensor. A row past R reads row R - 1, never past the buffer (the runner
refuses such rows before a step is sent).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op

BLOCK = 1024


@compile_ahead.kernel
@triton.jit
def _fed_back_kernel(ids_ptr, prev_ptr, feedback_ptr, out_ptr, n, rows, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n
    prev = tl.load(prev_ptr + t, mask=ok, other=-1)
    staged = tl.load(ids_ptr + t, mask=ok, other=0)
    fed = tl.load(feedback_ptr + tl.minimum(tl.maximum(prev, 0), rows - 1), mask=ok & (prev >= 0), other=0)
    tl.store(out_ptr + t, tl.where(prev >= 0, fed, staged), mask=ok)


@custom_op("fullgraph::fed_back_ids", mutates_args=())
def fed_back_ids(input_ids: torch.Tensor, prev_token_row: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
    """(T,) int64: ``feedback[prev_token_row[t]]`` where that row is >= 0, else ``input_ids[t]``."""
    n = input_ids.shape[0]
    out = compile_ahead.output((n,), torch.int64, input_ids.device)
    if n:
        _fed_back_kernel[(triton.cdiv(n, BLOCK),)](input_ids, prev_token_row, feedback, out, n, feedback.shape[0],
                                                   BLOCK=BLOCK, num_warps=4, **pdl.options(input_ids))
    return out


@fed_back_ids.register_fake
def _(input_ids, prev_token_row, feedback):
    return torch.empty_like(input_ids)
