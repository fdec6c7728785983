"""Which kernel serves a linear layer of a few rows (2 .. ``MAX_ROWS``): ours or cuBLAS.

One row always runs our weight-streaming kernel (``linear.launch``: faster than cuBLAS there, and
the only one that fuses the RMSNorm on load and the residual add). For a few rows, cuBLAS's
tensor-core kernels may stream the weights faster than ours even with the norm, the activation
and the add as launches of their own; which one wins depends on the shape. So the first call of
each shape outside a capture (a runner's warm-up runs every captured size before it captures)
times both on the real arguments and keeps the faster one for the process; a capture only looks
the choice up, never measures (a shape not yet seen there takes cuBLAS). ``FULLGRAPH_LINEAR``
(``fullgraph.env``) forces either one.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import env
from . import activation as act
from . import compile_ahead, norm

logger = logging.getLogger("fullgraph")

MAX_ROWS = 64   # more rows take cuBLAS (with the norm and the activation as kernels of their own)
_choice: dict[tuple, bool] = {}   # shape key -> whether our kernel was the faster


def choices() -> dict[tuple, bool]:
    """The measured choices so far: (rows, N, K, dtype, bias, activation, norm, residual) -> ours."""
    return dict(_choice)


def triton_wins(key: tuple, x: torch.Tensor, ours: Callable[[], torch.Tensor],
                theirs: Callable[[], torch.Tensor]) -> bool:
    """Whether our kernel (the call ``ours``) serves the linear of shape ``key`` on ``x`` (more than
    one row) rather than ``theirs`` (:func:`unfused`): measured once per key outside a capture."""
    if x.shape[0] > MAX_ROWS:  # prefill: tiles of every row would not fit
        return False
    impl = env.linear_impl()
    if impl != "auto":
        return impl == "triton"
    if not x.is_cuda:  # the interpreter: ours, the kernel under test
        return True
    won = _choice.get(key)
    if won is not None:
        return won
    if compile_ahead._active:  # collecting kernels to compile: ours, so the measurement finds it built
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    t_ours, t_theirs = _time(ours), _time(theirs)
    _choice[key] = won = t_ours < t_theirs
    logger.debug("fullgraph: linear %s: ours %.1f us, cuBLAS %.1f us", key, t_ours, t_theirs)
    return won


def _time(fn, reps: int = 20) -> float:
    """Microseconds per call (after two untimed calls, the first of which may compile)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def unfused(x, w, b, activation, limit, norm_weight, eps, residual) -> torch.Tensor:
    """What ``linear.linear`` computes, with cuBLAS for the product: the norm and the gated activation
    as our kernels, the residual added by cuBLAS's epilogue (``addmm``) where there is no bias."""
    if norm_weight is not None:
        x = norm.rms_norm(x, norm_weight, eps)
    if residual is not None and b is None:
        return torch.addmm(residual, x, w.t())
    y = F.linear(x, w, b)
    if activation == "silu_and_mul":
        y = act.silu_and_mul(y)
    elif activation == "gegelu":
        y = act.gegelu(y, limit)
    return y if residual is None else y.add_(residual)
