"""Programmatic dependent launch (``fullgraph.kernels.pdl``): when it is on, and that a captured
chain of dependent kernels launched with it computes what the same chain computes in float64."""
from __future__ import annotations

import pytest
import torch

import fullgraph.env
from fullgraph.kernels import pdl
from fullgraph.kernels.linear import launch as linear
from fullgraph.kernels.norm import add_rms_norm


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl.options(torch.empty(1)) == {"USE_PDL": False}
    # The interpreter rule on its own (a CPU tensor alone never reaches it): with it deleted,
    # asking for device 0's capability fails on a machine without CUDA, or says yes on a Hopper.
    monkeypatch.setattr(fullgraph.env, "triton_interpret", lambda: True)
    assert pdl._enabled.__wrapped__(0) is False
    monkeypatch.setattr(fullgraph.env, "pdl_disabled", lambda: True)
    monkeypatch.setattr(fullgraph.env, "triton_interpret", lambda: False)
    assert pdl._enabled.__wrapped__(0) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_env_switch_is_read_once(monkeypatch):
    monkeypatch.setenv(fullgraph.env.PDL, "0")
    fullgraph.env.pdl_disabled.cache_clear()
    pdl._enabled.cache_clear()
    try:
        assert pdl.options(torch.empty(1, device="cuda")) == {"USE_PDL": False}
    finally:
        monkeypatch.delenv(fullgraph.env.PDL)
        fullgraph.env.pdl_disabled.cache_clear()
        pdl._enabled.cache_clear()
    want = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.options(torch.empty(1, device="cuda"))["USE_PDL"] is want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_dependent_chain_matches_float64():
    """norm -> linear -> linear -> norm ... : each kernel reads what the one before it wrote a
    moment earlier, with weights prefetched before the wait. A read ahead of the wait would show
    as a stale (NaN-poisoned) input."""
    gen = torch.Generator("cuda").manual_seed(0)
    hidden, inter, layers = 2048, 4096, 12
    w_up = [torch.randn(2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5 for _ in range(layers)]
    w_down = [torch.randn(hidden, inter, device="cuda", generator=gen) * inter ** -0.5 for _ in range(layers)]
    scale = [1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen) for _ in range(layers)]
    x_in = torch.full((1, hidden), float("nan"), device="cuda")
    res_in = torch.full((1, hidden), float("nan"), device="cuda")

    def chain(x, res):
        for i in range(layers):
            y, res = add_rms_norm(x, res, scale[i], 1e-6)
            x = linear(linear(y, w_up[i], None, "silu_and_mul"), w_down[i], None)
        return x + res

    def reference(x, res):
        x, res = x.double(), res.double()
        for i in range(layers):
            res = x + res
            y = scale[i].double() * res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + 1e-6)
            gate, up = (y @ w_up[i].double().t()).chunk(2, dim=-1)
            x = (torch.nn.functional.silu(gate) * up) @ w_down[i].double().t()
        return x + res

    x_in.normal_(generator=gen), res_in.normal_(generator=gen)
    chain(x_in, res_in)                                       # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x_in, res_in)
    for _ in range(5):
        x_in.normal_(generator=gen), res_in.normal_(generator=gen)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out.double(), reference(x_in, res_in), rtol=1e-4, atol=1e-4)
