"""Which kernel serves a linear layer: ours, the split-K one or cuBLAS.

One row runs our weight-streaming kernel (``linear.launch``: faster than cuBLAS there, and
the only one that fuses the RMSNorm on load and the residual add). For more rows cuBLAS's
tensor-core kernels stream the weights faster than our ``tl.dot`` path (H200 and H100, 2026-12-05,
``benchmarks/sweep_linear.py``: at 32 rows ours takes about twice cuBLAS's time on every layer
shape measured, at 8 rows it is even), even with the norm, the activation and the add as launches
of their own (:func:`unfused`), so they take cuBLAS; ``FULLGRAPH_LINEAR=triton`` (``fullgraph.env``)
forces ours (benchmarks, tests), ``FULLGRAPH_LINEAR=skinny`` the split-K weight-streaming kernel
(``skinny_linear``: x is read once per 64-128 weight rows, not per 16-32, and its weight tiles
are pipelined through shared memory) for 2-64 rows, with which the models fuse the norm, the
residual add and RoPE + the KV write into their projections at every such step; it is opt-in
while it measures slower in the model (H100, 2026-12-06: llama-1b batch 32 1.811 -> 2.160 ms
with its first launch config; the one the kernel sweep chose since is not timed in the model).
Under the Triton interpreter (no CUDA) ours runs: the kernel under test. A choice measured at run
time would have to time each candidate inside a CUDA graph over weights that miss the L2, as a
step sees them: timed eagerly, back to back, launch overhead and a cache-resident weight decided
it, and chose ours where it is twice as slow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import env
from . import activation as act
from . import norm

MAX_ROWS = 64   # more rows take cuBLAS (with the norm and the activation as kernels of their own)


def choose(x: torch.Tensor) -> str:
    """Which kernel serves a linear of ``x``'s rows: ``"triton"`` (``linear.launch``), ``"skinny"``
    (``skinny_linear.launch``) or ``"cublas"`` (:func:`unfused`). One row always takes
    ``linear.launch`` (H100, ``sweep_linear.py --skinny``: 4.9-23.1 us against the split-K kernel's
    6.4-25.0 on llama-1b's four matrices); ``FULLGRAPH_LINEAR=skinny`` sends 2-64 rows to the split-K one."""
    if x.shape[0] > MAX_ROWS:  # prefill: tiles of every row would not fit
        return "cublas"
    impl = env.linear_impl()
    if x.shape[0] == 1:   # the one-row kernel beats the split-K one at every layer shape measured
        return "triton"
    if impl != "auto":
        return impl
    return "cublas" if x.is_cuda else "triton"


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
