"""RMSNorm and LayerNorm, optionally fused with the residual add before them: one launch instead
of the two to eight eager PyTorch needs (a decode step runs two per layer).

Algorithm, per row (one program per token)::

    h = x + residual                 (in the input dtype, as the reference models add)
    RMSNorm:   y = weight * (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(dtype)
    LayerNorm: y = ((h.float() - mean) * rsqrt(var + eps) * weight + bias).to(dtype)
               (biased variance; float32 math throughout, as ``F.layer_norm`` on bf16 inputs)

Layout contract: x, residual: (T, N) with unit stride along N (rows may be strided); weight,
bias: (N,). The plain forms return y; the ``add_`` forms return (y, h). Outputs are new
contiguous (T, N) tensors in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .._compat import custom_op


@compile_ahead.kernel
@triton.jit
def _norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr,     # pointers
    n_cols, eps,                                    # sizes
    stride_x, stride_res,                           # row strides
    HAS_RESIDUAL: tl.constexpr, LAYER_NORM: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)           # parameters: before the wait
    if LAYER_NORM:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0)
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    if LAYER_NORM:
        centred = tl.where(mask, xf - tl.sum(xf, axis=0) / n_cols, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        y = (centred * inv * w.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    else:
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = w * (xf * inv).to(x.dtype)
    tl.store(y_ptr + row * n_cols + cols, y, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
            residual: torch.Tensor | None):
    num_rows, n_cols = x.shape
    if x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError(f"norm: x {tuple(x.shape)} and residual need equal shapes and unit stride "
                         "along the last dim")
    y = compile_ahead.output((num_rows, n_cols), x.dtype, x.device)
    h = compile_ahead.output(y.shape, y.dtype, y.device) if residual is not None else y
    if num_rows:
        _norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, bias if bias is not None else weight, y, h,
            n_cols, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None, LAYER_NORM=bias is not None,
            BLOCK=triton.next_power_of_2(n_cols), num_warps=4 if n_cols <= 2048 else 8, **pdl.options(x))
    return y, h


def _fake_like(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@custom_op("fullgraph::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = RMSNorm(x) * weight, (T, N) -> (T, N)."""
    return _launch(x, weight, None, eps, None)[0]


@rms_norm.register_fake
def _(x, weight, eps):
    return _fake_like(x)


@custom_op("fullgraph::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with h = x + residual and y = RMSNorm(h) * weight."""
    return _launch(x, weight, None, eps, residual)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return _fake_like(x), _fake_like(x)


@custom_op("fullgraph::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """y = LayerNorm(x) * weight + bias, (T, N) -> (T, N)."""
    return _launch(x, weight, bias, eps, None)[0]


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return _fake_like(x)


@custom_op("fullgraph::add_layer_norm", mutates_args=())
def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with h = x + residual and y = LayerNorm(h) * weight + bias."""
    return _launch(x, weight, bias, eps, residual)


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    return _fake_like(x), _fake_like(x)
