"""RMSNorm (optionally after the residual add) fused into the one-row linear after it: the norm
and the projection of a decode row in one launch instead of two.

A batch-1 decode step runs two norms a decoder layer, each its own launch (of about nine kernels
a layer); the row they normalise is a few KB and every program of the projection reads it
anyway. So each program here normalises the row itself before streaming its weight columns.

Algorithm, for the one row x (K,) (and residual r), with g the norm weight::

    h = x + r                                   (in x's dtype, as ``kernels.add_rms_norm``)
    inv = 1 / sqrt(mean(h.float() ** 2) + eps)  (float32; the squares summed BLOCK_K at a time)
    y = g * (h.float() * inv).to(dtype)         (exactly the norm's rounding)
    out = y @ w.T (+ b), then the optional gated activation, as ``kernels.linear``

Every program makes the first pass over the row (sum of squares) and normalises each K block as
it streams the weight: the row is read twice per program from L2 (K x 2 bytes), against the
weight's BLOCK_N x K. Program 0 also stores h, the new residual stream. The sum's order differs
from ``kernels.add_rms_norm``'s (one block over the whole row), so ``inv`` can differ from the
unfused pair's in its last bits.

Layout contract: x, residual (1, K) with unit column stride; norm_weight (K,); w (N, K)
contiguous; b (N,) or None. Returns (out (1, N), or (1, N // 2) with a gated activation, and
h (1, K), new tensors in x's dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op
from .linear import ACTIVATIONS, NO_LIMIT, columns, launch_config, store


@compile_ahead.kernel
@triton.jit
def _norm_linear_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, h_ptr,
    N, K, eps, limit,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn, n_ok = columns(pid, N, ACT, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    k_ok = rk < K
    # parameters before the wait: the first weight tile and the bias
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    # pass 1: the row's mean square (and, in program 0, the residual sum h)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + rk < K
        h = tl.load(x_ptr + k0 + rk, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            h = h + tl.load(res_ptr + k0 + rk, mask=ok, other=0.0)
        if pid == 0:
            tl.store(h_ptr + k0 + rk, h, mask=ok)
        hf = h.to(tl.float32)
        squares += hf * hf
    inv = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    # pass 2: normalise each K block as the weight streams past it
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + rk < K
        if k0 > 0:
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0)
        h = tl.load(x_ptr + k0 + rk, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            h = h + tl.load(res_ptr + k0 + rk, mask=ok, other=0.0)
        g = tl.load(g_ptr + k0 + rk, mask=ok, other=0.0)
        y = g * (h.to(tl.float32) * inv).to(h.dtype)
        acc += tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += bias
    store(acc[None, :], out_ptr, 1, 0, pid, rn, n_ok, N, limit, ACT, 1, BLOCK_N)


def _check(x, residual, norm_weight, w, b, activation) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_linear: x must be one row (1, K) with unit column stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    k, n = x.shape[1], w.shape[0]
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm_linear: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != (k,) or w.dim() != 2 or w.shape[1] != k or w.stride() != (k, 1) or \
            (b is not None and b.shape != (n,)):
        raise ValueError(f"rms_norm_linear: norm_weight {tuple(norm_weight.shape)} must be ({k},), w (N, {k}) "
                         f"contiguous, b (N,) or None; got w {tuple(w.shape)} strides {w.stride()}, b "
                         f"{None if b is None else tuple(b.shape)}")
    if activation not in ACTIVATIONS or (activation != "none" and n % 2):
        raise ValueError(f"rms_norm_linear: activation must be one of {sorted(ACTIVATIONS)} (gated ones need an "
                         f"even number of weight rows), got {activation!r} with {n} rows")


def launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
           b: torch.Tensor | None, activation: str = "none", limit: float = NO_LIMIT,
           config: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher behind :func:`rms_norm_linear`; ``config`` (BLOCK_N, BLOCK_K, num_warps)
    overrides ``linear.launch_config`` (tests and sweeps)."""
    _check(x, residual, norm_weight, w, b, activation)
    k, n = x.shape[1], w.shape[0]
    out = compile_ahead.output((1, n if activation == "none" else n // 2), x.dtype, x.device)
    h = compile_ahead.output((1, k), x.dtype, x.device)
    block_n, block_k, num_warps = config or launch_config(n)
    _norm_linear_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight, w, b if b is not None else w, out, h,
        n, k, eps, limit,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=b is not None, ACT=ACTIVATIONS[activation],
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **pdl.options(x))
    return out, h


@custom_op("fullgraph::rms_norm_linear", mutates_args=())
def _rms_norm_linear_op(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor, b: torch.Tensor | None, activation: str,
                        limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    return launch(x, residual, norm_weight, eps, w, b, activation, limit)


@_rms_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, w, b, activation, limit):
    n = w.shape[0] if activation == "none" else w.shape[0] // 2
    return x.new_empty((1, n)), x.new_empty(x.shape)


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                    b: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
                    activation: str = "none", limit: float = NO_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(RMSNorm(x + residual) * norm_weight, w, b, activation), x + residual)`` for one
    row, in one launch (see the module docstring). Without a residual the second value is a copy
    of x, written by the same launch (a custom op's output may not alias its input)."""
    _check(x, residual, norm_weight, w, b, activation)
    return _rms_norm_linear_op(x, residual, norm_weight, eps, w, b, activation, limit)
