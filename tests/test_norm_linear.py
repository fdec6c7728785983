"""RMSNorm fused into the one-row linear (``fullgraph::rms_norm_linear``) against a float64
reference and against the unfused pair of kernels (``add_rms_norm`` then ``linear``): residual or
not, bias or not, every gated activation, several K blocks, and the front door's refusals."""
from __future__ import annotations

import pytest
import torch

from fullgraph import kernels
from fullgraph.kernels.norm_linear import launch, rms_norm_linear
from test_linear_kernel import ref_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def ref(x, residual, g, w, b, activation, limit):
    h = x.double() + (0 if residual is None else residual.double())
    y = g.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return ref_linear(y, w, b, activation, limit), h


@pytest.mark.parametrize("activation", ["none", "gegelu", "silu_and_mul"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(activation, residual, bias):
    n, k = 44, 97                       # neither a multiple of the column block nor of the K block
    x = 3 * torch.randn(2, k, device=DEVICE)[::2]                     # a strided row, not unit scale
    r = torch.randn(1, k, device=DEVICE) if residual else None
    g, w = torch.randn(k, device=DEVICE), torch.randn(n, k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    limit = 1.5                         # random outputs of size ~10 hit the GeGeLU clamp
    got, h = launch(x, r, g, EPS, w, b, activation, limit, config=(8, 32, 4))
    want, _ = ref(x, r, g, w, b, activation, limit)
    assert got.shape == want.shape and got.dtype == x.dtype and h.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(h, x if r is None else x + r)                  # h = x + r exactly, in x's dtype


def test_equals_the_unfused_kernels():
    """The same math as ``add_rms_norm`` then ``linear`` (the launches it replaces), one K block
    and several, through the registered op as models would call it."""
    torch.manual_seed(0)
    for k, config in ((200, (4, 1024, 8)), (200, (8, 64, 4))):
        x, r = torch.randn(1, k, device=DEVICE), torch.randn(1, k, device=DEVICE)
        g, w = 1 + 0.1 * torch.randn(k, device=DEVICE), torch.randn(64, k, device=DEVICE)
        y, h = kernels.add_rms_norm(x, r, g, EPS)
        want = kernels.linear(y, w, None, "silu_and_mul")
        got, got_h = launch(x, r, g, EPS, w, None, "silu_and_mul", config=config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_h, h)
    got, got_h = rms_norm_linear(x, g, EPS, w)
    torch.testing.assert_close(got, kernels.linear(kernels.rms_norm(x, g, EPS), w), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_h, x) and got_h.data_ptr() != x.data_ptr()


def test_bad_inputs_raise_before_launching():
    x, g, w = torch.randn(1, 16), torch.randn(16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="one row"):
        rms_norm_linear(torch.randn(2, 16), g, EPS, w)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_linear(x, g, EPS, w, residual=torch.randn(1, 15))
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_linear(x, torch.randn(15), EPS, w)
    with pytest.raises(ValueError, match="activation"):
        rms_norm_linear(x, g, EPS, torch.randn(7, 16), activation="silu_and_mul")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,activation", [(3072, 2048, "none"), (16384, 2048, "silu_and_mul"), (960, 576, "none")])
def test_bf16_on_the_gpu_matches_the_unfused_kernels(n, k, activation):
    torch.manual_seed(0)
    dt = torch.bfloat16
    x, r = torch.randn(1, k, device="cuda", dtype=dt), torch.randn(1, k, device="cuda", dtype=dt)
    g, w = 1 + 0.1 * torch.randn(k, device="cuda", dtype=dt), torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5
    y, h = kernels.add_rms_norm(x, r, g, EPS)
    want = kernels.linear(y, w, None, activation)
    got, got_h = rms_norm_linear(x, g, EPS, w, residual=r, activation=activation)
    assert torch.equal(got_h, h)
    ref_out, _ = ref(x, r, g, w, None, activation, float("inf"))
    # the flash-attention rule against float64: the fused kernel's error is at most twice the two
    # launches' own (a bf16 output is off by up to half an ulp of its value, 0.016 near 4, so a fixed
    # atol judges rounding, not the kernel); plus one bf16 ulp at the largest value for a last-bit tie
    err_fused = (got.double() - ref_out).abs().max().item()
    err_unfused = (want.double() - ref_out).abs().max().item()
    ulp = ref_out.abs().max().item() * 2.0 ** -7
    assert err_fused <= 2 * err_unfused + ulp, (err_fused, err_unfused, ulp)
    assert err_unfused < 0.05 * ref_out.abs().max().item(), (err_unfused, ref_out.abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
