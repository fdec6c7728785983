"""Fused RMSNorm / RoPE / gated activations against plain-PyTorch references (float64)."""
from __future__ import annotations

import math

import pytest
import torch

from fullgraph.kernels.activation import gegelu, silu_and_mul
from fullgraph.kernels.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from fullgraph.kernels.rope import rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ref_rms(h, w, eps):
    h = h.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def ref_rope(x, positions, cos, sin):
    x = x.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)


def ref_gegelu(u, limit):
    u = u.double()
    a, b = u[:, 0::2], u[:, 1::2]
    a = torch.where(torch.isinf(a), a, a.clamp(max=limit))
    b = torch.where(torch.isinf(b), b, b.clamp(-limit, limit))
    return a * torch.sigmoid(1.702 * a) * (b + 1)


def check(got, want, same_dtype_err=None):
    """float32: tight; half precision: the flash-attention rule against PyTorch's own error."""
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    if same_dtype_err is None:
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), err
    else:
        assert err <= 2 * same_dtype_err + 1e-3, (err, same_dtype_err)


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 100), (33, 256)])
def test_rms_norm_and_fused_add(rows, cols):
    x = torch.randn(rows, 2 * cols, device=DEVICE)[:, :cols]        # strided rows, like a split output
    res = torch.randn(rows, cols, device=DEVICE)
    w = 1 + 0.1 * torch.randn(cols, device=DEVICE)
    check(rms_norm(x, w, 1e-6), ref_rms(x, w, 1e-6))
    y, h = add_rms_norm(x, res, w, 1e-6)
    check(h, (x + res).double())
    check(y, ref_rms(x + res, w, 1e-6))


@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 100), (3, 4096)])
def test_layer_norm_and_fused_add(rows, cols):
    x = 3 + torch.randn(rows, 2 * cols, device=DEVICE)[:, :cols]    # strided rows, a mean far from 0
    res = torch.randn(rows, cols, device=DEVICE)
    w, b = 1 + 0.1 * torch.randn(cols, device=DEVICE), torch.randn(cols, device=DEVICE)

    def ref(h):
        return torch.nn.functional.layer_norm(h.double(), (cols,), w.double(), b.double(), 1e-5)

    check(layer_norm(x, w, b, 1e-5), ref(x))
    y, h = add_layer_norm(x, res, w, b, 1e-5)
    check(h, (x + res).double())
    check(y, ref(x + res))


def test_rope_reads_head_major_grouped_q():
    """Phi-3-Small's fused QKV interleaves each KV group's query heads with its k and v rows."""
    tokens, kv_heads, group, dim = 5, 2, 3, 32
    qkv = torch.randn(tokens, kv_heads, group + 2, dim, device=DEVICE)
    q, k = qkv[:, :, :group], qkv[:, :, group]
    positions = torch.randint(0, 40, (tokens,), device=DEVICE)
    angles = torch.rand(40, dim // 2, device=DEVICE) * 6
    q_out, k_out = rope(q, k, positions, angles.cos(), angles.sin())
    assert q_out.shape == (tokens, kv_heads * group, dim)
    check(q_out, ref_rope(q.reshape(tokens, -1, dim), positions, angles.cos(), angles.sin()))
    check(k_out, ref_rope(k, positions, angles.cos(), angles.sin()))


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 80), (32, 8, 128)])
def test_rope_q_and_k_in_one_launch(heads, kv_heads, dim):
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)                  # views of a fused projection
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 50, (tokens,), device=DEVICE)
    angles = torch.rand(50, dim // 2, device=DEVICE) * 6
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3                   # an mscale folded in
    q_out, k_out = rope(q, k, positions, cos, sin)
    check(q_out, ref_rope(q, positions, cos, sin))
    check(k_out, ref_rope(k, positions, cos, sin))


@pytest.mark.parametrize("rows,inter", [(1, 96), (5, 1500)])
def test_silu_and_mul(rows, inter):
    u = torch.randn(rows, 2 * inter, device=DEVICE)
    want = torch.nn.functional.silu(u[:, :inter].double()) * u[:, inter:].double()
    check(silu_and_mul(u), want)


def test_gegelu_clamps_and_passes_infinities():
    u = 4 * torch.randn(6, 2 * 700, device=DEVICE)
    u[0, 0], u[0, 2], u[1, 1], u[1, 3] = math.inf, -math.inf, math.inf, -math.inf
    got, want = gegelu(u, 2.0), ref_gegelu(u, 2.0)
    finite = torch.isfinite(want)
    assert (~finite).sum() >= 3  # inf in a (not capped at the limit) and in b (not clamped) stay inf
    assert torch.equal(got[~finite].double().nan_to_num(), want[~finite].nan_to_num())
    check(torch.where(finite, got, 0), torch.where(finite, want, 0))


def test_ops_trace_under_compile_fullgraph():
    x = torch.randn(3, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    fn = torch.compile(lambda x, w: silu_and_mul(add_rms_norm(x, x, w, 1e-6)[0]), fullgraph=True, backend="aot_eager")
    check(fn(x, w), torch.nn.functional.silu(ref_rms(2 * x, w, 1e-6)[:, :16]) * ref_rms(2 * x, w, 1e-6)[:, 16:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_pytorch_error(dtype):
    x, res = torch.randn(64, 2048, device="cuda"), torch.randn(64, 2048, device="cuda")
    w = 1 + 0.1 * torch.randn(2048, device="cuda")
    want = ref_rms(x.to(dtype) + res.to(dtype), w.to(dtype), 1e-5)
    xf, rf = (x.to(dtype) + res.to(dtype)).float(), w.to(dtype)
    torch_err = (rf * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) - want).abs().max().item()
    check(add_rms_norm(x.to(dtype), res.to(dtype), w.to(dtype), 1e-5)[0], want, torch_err)
    u = torch.randn(64, 2 * 4096, device="cuda", dtype=dtype)
    want = torch.nn.functional.silu(u[:, :4096].double()) * u[:, 4096:].double()
    torch_err = (torch.nn.functional.silu(u[:, :4096]) * u[:, 4096:] - want).abs().max().item()
    check(silu_and_mul(u), want, torch_err)
