"""RMSNorm, optionally fused with the residual add before it: one launch instead of about eight.

Algorithm, per row (one program per token)::

    h = x + residual                 (in the input dtype, as the reference model adds)
    y = weight * (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(dtype)

Layout contract: x, residual: (T, N) with unit stride along N (rows may be strided); weight: (N,).
``rms_norm`` returns y; ``add_rms_norm`` returns (y, h). Outputs are new contiguous (T, N)
tensors in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr,          # pointers
    n_cols, eps,                                    # sizes
    stride_x, stride_res,                           # row strides
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, w * (xf * inv).to(x.dtype), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    num_rows, n_cols = x.shape
    if x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and residual need equal shapes and unit stride "
                         "along the last dim")
    y = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else y
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, y, h, n_cols, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8)
    return y, h


@torch.library.custom_op("fullgraph::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = RMSNorm(x) * weight, (T, N) -> (T, N)."""
    return _launch(x, weight, eps, None)[0]


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fullgraph::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with h = x + residual and y = RMSNorm(h) * weight."""
    return _launch(x, weight, eps, residual)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)
