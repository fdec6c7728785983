"""Skinny matrix products for decode steps: ``y = x @ w.T + bias`` with few rows in ``x``.

A decode step of a batch of B requests multiplies a (B, K) activation by every (N, K) weight
matrix; at small B that is a pure read of the weights, bound by memory bandwidth. cuBLAS picks
GEMM tiles for these shapes that launch too few thread blocks for the smaller matrices (a
2048x3072 projection ran at ~1.8 TB/s on an H200 where the large ones reach 3.8): this kernel
spreads the weight rows over many programs instead, one pass, bias fused, fp32 accumulation.

Algorithm: program n owns output columns ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` for all M rows
and walks K in BLOCK_K steps, accumulating ``sum_k x[m, k] * w[n, k]`` in float32 (an
elementwise product and a row reduction: the rows are too few for tensor cores to matter).
No split over K, so no second pass and a deterministic result.

Layout contract: x (M, K) with unit stride along K (rows may be strided), w (N, K) contiguous,
bias (N,) or None; returns a new contiguous (M, N) in x's dtype. ``gemv_rows`` says up to how
many rows this path is used; ``linear`` falls back to ``F.linear`` (cuBLAS) above it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 8  # above this, cuBLAS GEMM tiles fill the GPU well


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=rm[:, None] < M, other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                        other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]      # (BM, BN, BK)
        acc += tl.sum(prod, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None] * stride_y + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


def default_gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """Tile choice by shape (measured on an H200; see benchmarks/bench_gemv.py)."""
    return GemvConfig()


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for x (M, K) with M <= MAX_ROWS; see the module docstring."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(-1) != 1 or not w.is_contiguous() \
            or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most {MAX_ROWS} rows, unit stride along K), "
                         f"w {tuple(w.shape)} contiguous (N, K), bias (N,) or None; got bias "
                         f"{None if bias is None else tuple(bias.shape)}")
    cfg = config or default_gemv_config(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=max(triton.next_power_of_2(m), 1), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


@torch.library.custom_op("fullgraph::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for (T, K) activations: the skinny kernel at T <= MAX_ROWS, cuBLAS above.

    One opaque op, so a compiled step keeps the choice (made when the shape is known) too."""
    if x.shape[0] <= MAX_ROWS and x.stride(-1) == 1:
        return gemv(x, w, bias)
    return F.linear(x, w, bias)


@linear.register_fake
def _(x, w, bias=None):
    return x.new_empty((x.shape[0], w.shape[0]))
