"""``y = x @ w.T (+ b)`` for few rows (decode batches): a weight-streaming GEMM.

At decode batch sizes a linear layer reads its whole weight to produce a few output rows, so
its time is the weight's bytes over the bandwidth one launch reaches.

Algorithm: one program per BLOCK_N output columns walks K in BLOCK_K steps, loading a
(BLOCK_N, BLOCK_K) weight tile and the matching (M, BLOCK_K) slice of x (a few KB, L2-resident)
and accumulating in float32: a broadcast multiply and row sum for one row, ``tl.dot`` (rows
padded to 16) otherwise. Bias is added in the epilogue, then optionally a gated activation
(GeGeLU over interleaved column pairs, SwiGLU over [gate | up] halves, whose rows a program
loads interleaved), so the MLP's up-projection and activation are one launch.

Layout contract: x (M, K) with unit column stride, w (N, K) contiguous, b (N,) or None;
returns a new (M, N) tensor in x's dtype. Registered as ``fullgraph::linear`` (with a fake), so
``torch.compile`` keeps it one opaque launch. Models use it for one-row steps only
(``models.layers.Linear``): for 16 rows and more cuBLAS's tensor-core kernels are faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op


@triton.jit
def columns(pid, N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows program ``pid`` reads (and which exist): BLOCK_N consecutive rows, or with
    SwiGLU (ACT 2) gate row c and up row c interleaved, so each program's pairs are adjacent."""
    j = tl.arange(0, BLOCK_N)
    if ACT == 2:  # [gate | up] halves: local rows interleave gate row c and up row c
        col = pid * (BLOCK_N // 2) + j // 2
        rn = (j % 2) * (N // 2) + col
        n_ok = col < N // 2
    else:
        rn = pid * BLOCK_N + j
        n_ok = rn < N
    return rn, n_ok


@triton.jit
def store(acc, out_ptr, M, stride_om, pid, rn, n_ok, N, limit, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """Store the (BLOCK_M, BLOCK_N) float32 results of :func:`columns`' rows, through the gated
    activation when ACT is 1 (GeGeLU over adjacent pairs) or 2 (SwiGLU)."""
    rm = tl.arange(0, BLOCK_M)
    if ACT == 0:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & n_ok[None, :])
    else:  # pairs (a, b) are adjacent local columns
        a, b = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        if ACT == 1:  # GeGeLU: a = min(a, limit), b = clamp(b, -limit, limit), infinities unchanged
            a = tl.where(a == float("inf"), a, tl.minimum(a, limit))
            b = tl.where((b == float("inf")) | (b == -float("inf")), b, tl.minimum(tl.maximum(b, -limit), limit))
            y = a * tl.sigmoid(1.702 * a) * (b + 1.0)
        else:  # SwiGLU
            y = a * tl.sigmoid(a) * b
        oc = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rm[:, None] * stride_om + oc[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (oc < N // 2)[None, :])


@compile_ahead.kernel
@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, limit,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn, n_ok = columns(pid, N, ACT, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    # The first weight tile and the bias are parameters: load them before waiting for x.
    k_ok = rk < K
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
        acc1 = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k_ok = k0 + rk < K
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0)
            acc1 += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        acc = acc1[None, :]
    else:
        rows = tl.arange(0, BLOCK_M)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k_ok = k0 + rk < K
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + rk)[None, :],
                        mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += bias[None, :]
    store(acc, out_ptr, M, stride_om, pid, rn, n_ok, N, limit, ACT, BLOCK_M, BLOCK_N)


def launch_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for one row and N output columns, from
    ``benchmarks/sweep_linear.py`` on an H200 (bf16, the llama-1b and Phi-3-Small layers): narrow
    layers need small column blocks for enough programs to stream HBM; wide ones do not."""
    if n <= 3072:
        return 4, 1024, 8
    if n <= 4096:
        return 8, 1024, 8
    if n <= 8192:
        return 4, 512, 4
    return 32, 256, 8


ACTIVATIONS = {"none": 0, "gegelu": 1, "silu_and_mul": 2}
NO_LIMIT = 1e38   # a GeGeLU limit no finite float32 value reaches (an op schema cannot default to inf)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str = "none",
           limit: float = NO_LIMIT, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The launcher behind :func:`linear`; ``config`` (BLOCK_N, BLOCK_K, num_warps) overrides
    :func:`launch_config` (benchmarks sweep it)."""
    (m, k), n = x.shape, w.shape[0]
    if activation not in ACTIVATIONS or (activation != "none" and n % 2):
        raise ValueError(f"linear: activation must be one of {sorted(ACTIVATIONS)} (gated ones need an even "
                         f"number of weight rows), got {activation!r} with {n} rows")
    if w.shape[1] != k or w.stride() != (k, 1) or x.stride(-1) != 1 or (b is not None and b.shape != (n,)):
        raise ValueError(f"linear: x {tuple(x.shape)} (unit column stride), w {tuple(w.shape)} contiguous with "
                         f"{k} columns, b (N,) or None; got w strides {w.stride()}, b "
                         f"{None if b is None else tuple(b.shape)}")
    out = compile_ahead.output((m, n if activation == "none" else n // 2), x.dtype, x.device)
    if m == 0:
        return out
    block_n, block_k, num_warps = config or launch_config(n)
    if m > 1 and config is None:  # rows padded to 16 for tl.dot
        block_n, block_k, num_warps = max(block_n, 16), min(block_k, 512), 4
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _linear_kernel[(triton.cdiv(n, block_n),)](
        x, w, b if b is not None else w, out, m, n, k, limit, x.stride(0), out.stride(0),
        HAS_BIAS=b is not None, ACT=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, **pdl.options(x))
    return out


@custom_op("fullgraph::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, activation: str = "none",
           limit: float = NO_LIMIT) -> torch.Tensor:
    """``x @ w.T + b`` (M, K) x (N, K) -> (M, N) in x's dtype, float32 accumulation; with a gated
    ``activation`` ("gegelu" over interleaved columns, "silu_and_mul" over [gate | up] halves, as
    in ``kernels.activation``) applied to the float32 result: -> (M, N // 2)."""
    return launch(x, w, b, activation, limit)


@linear.register_fake
def _(x, w, b=None, activation="none", limit=NO_LIMIT):
    return x.new_empty((x.shape[0], w.shape[0] if activation == "none" else w.shape[0] // 2))
