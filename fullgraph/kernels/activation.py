"""Gated MLP activations in one launch: SwiGLU (Llama) and GeGeLU (Phi-3-Small).

Algorithms, per row of the fused up-projection ``u`` (T, 2I), computed in float32::

    silu_and_mul: gate, up = u[:, :I], u[:, I:];          out = silu(gate) * up
    gegelu:       a, b = u[:, 0::2], u[:, 1::2]            (interleaved columns)
                  a = min(a, limit); b = clamp(b, -limit, limit)   (infinities pass unchanged)
                  out = a * sigmoid(1.702 a) * (b + 1)

Layout contract: u (T, 2I) with unit stride along columns; returns a new contiguous (T, I) tensor
in u's dtype. One program per (row, BLOCK columns of the output).
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
def _gated_kernel(
    u_ptr, out_ptr,              # pointers
    inter, limit,                # sizes / constants
    stride_u,                    # row stride
    GEGELU: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = u_ptr + row * stride_u
    if GEGELU:
        a = tl.load(base + 2 * cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(base + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
        a = tl.where(a == float("inf"), a, tl.minimum(a, limit))
        b = tl.where((b == float("inf")) | (b == -float("inf")), b, tl.minimum(tl.maximum(b, -limit), limit))
        out = a * tl.sigmoid(1.702 * a) * (b + 1.0)
    else:
        gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(u: torch.Tensor, gegelu: bool, limit: float) -> torch.Tensor:
    num_rows, width = u.shape
    if u.stride(-1) != 1 or width % 2:
        raise ValueError(f"gated activation: u {tuple(u.shape)} needs an even width and unit column stride")
    out = compile_ahead.output((num_rows, width // 2), u.dtype, u.device)
    if num_rows:
        _gated_kernel[(num_rows, triton.cdiv(width // 2, BLOCK))](
            u, out, width // 2, limit, u.stride(0), GEGELU=gegelu, BLOCK=BLOCK, num_warps=4, **pdl.options(u))
    return out


@custom_op("fullgraph::silu_and_mul", mutates_args=())
def silu_and_mul(u: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: (T, 2I) -> (T, I)."""
    return _launch(u, gegelu=False, limit=0.0)


@silu_and_mul.register_fake
def _(u):
    return torch.empty((u.shape[0], u.shape[1] // 2), dtype=u.dtype, device=u.device)


@custom_op("fullgraph::gegelu", mutates_args=())
def gegelu(u: torch.Tensor, limit: float) -> torch.Tensor:
    """GeGeLU on interleaved [a0, b0, a1, b1, ...] columns: (T, 2I) -> (T, I)."""
    return _launch(u, gegelu=True, limit=limit)


@gegelu.register_fake
def _(u, limit):
    return torch.empty((u.shape[0], u.shape[1] // 2), dtype=u.dtype, device=u.device)
