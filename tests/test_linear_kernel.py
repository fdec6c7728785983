"""The weight-streaming linear kernel (``fullgraph::linear``) against float64 references:
one row and several, ragged sizes, bias, the fused gated activations, the models' use of it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fullgraph.kernels.linear import NO_LIMIT, launch, launch_config, linear
from fullgraph.models.layers import Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ref_linear(x, w, b, activation="none", limit=NO_LIMIT):
    y = x.double() @ w.double().t() + (0 if b is None else b.double())
    if activation == "gegelu":
        a, g = y[:, 0::2], y[:, 1::2]
        a = torch.where(torch.isinf(a), a, a.clamp(max=limit))
        g = torch.where(torch.isinf(g), g, g.clamp(-limit, limit))
        return a * torch.sigmoid(1.702 * a) * (g + 1)
    if activation == "silu_and_mul":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("activation", ["none", "gegelu", "silu_and_mul"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows, activation, bias):
    n, k = 44, 97                       # neither a multiple of the column block nor of the K block
    x = torch.randn(2 * rows, k, device=DEVICE)[::2]                  # strided rows
    w, b = torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE) if bias else None
    limit = 1.5                         # random outputs of size ~10 hit the GeGeLU clamp
    got = launch(x, w, b, activation, limit, config=(8, 32, 4))
    want = ref_linear(x, w, b, activation, limit)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_default_config_and_registered_op():
    x, w, b = torch.randn(1, 300, device=DEVICE), torch.randn(70, 300, device=DEVICE), torch.randn(70, device=DEVICE)
    assert launch_config(70) == launch_config(3072) != launch_config(4096) != launch_config(28672)
    got = torch.ops.fullgraph.linear(x, w, b)
    torch.testing.assert_close(got.double(), ref_linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert linear(x[:0], w, b).shape == (0, 70)


def test_bad_shapes_raise():
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        launch(x, w.t().contiguous().t(), None)
    with pytest.raises(ValueError, match="columns"):
        launch(torch.randn(1, 15), w, None)
    with pytest.raises(ValueError, match="activation"):
        launch(x, torch.randn(7, 16), None, "gegelu")
    with pytest.raises(ValueError, match="activation"):
        launch(x, w, None, "relu")


def test_module_uses_the_kernel_only_for_one_half_precision_row_on_cuda():
    lin = Linear(16, 8)
    one = torch.randn(1, 16)
    assert not lin.uses_kernel(one)                                    # CPU: F.linear
    torch.testing.assert_close(lin(one), F.linear(one, lin.weight, lin.bias))
    if torch.cuda.is_available():
        lin = lin.to("cuda", torch.bfloat16)
        one = one.to("cuda", torch.bfloat16)
        assert lin.uses_kernel(one)
        assert not lin.uses_kernel(torch.randn(2, 16, device="cuda", dtype=torch.bfloat16))
        assert not lin.uses_kernel(one.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(3072, 2048), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("activation", ["none", "gegelu", "silu_and_mul"])
def test_bf16_model_shapes_flash_rule(n, k, activation):
    """bf16 against float64, within twice the error of cuBLAS's own bf16 result (+ slack)."""
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    b = (0.02 * torch.randn(n, device="cuda", generator=gen)).bfloat16()
    want = ref_linear(x, w, b, activation, 20.0)
    cublas = F.linear(x, w, b)
    if activation != "none":
        cublas = torch.ops.fullgraph.gegelu(cublas, 20.0) if activation == "gegelu" \
            else torch.ops.fullgraph.silu_and_mul(cublas)
    got = linear(x, w, b, activation, 20.0)
    base = (cublas.double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * base + 1e-3


@pytest.mark.parametrize("preset", ["llama", "phi3"])
def test_models_on_the_one_row_kernel_path_match_the_separate_ops(monkeypatch, preset):
    """Force the one-row kernels (the path every CUDA batch-1 step takes: projections and the
    activation fused into the up-projection) on the CPU through the Triton interpreter: the
    decode steps' logits match the F.linear path."""
    import fullgraph as fg

    make = {"llama": lambda: fg.models.Llama(fg.models.LlamaConfig.toy()),
            "phi3": lambda: fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy())}[preset]

    def decode_logits():
        runner = fg.FullGraphRunner(make(), max_num_seqs=2, max_num_tokens=32, max_model_len=128,
                                    cudagraph="none", attention="sdpa")
        ids = runner.blocks.allocate(2)
        runner.step([fg.SeqChunk([5, 9, 2, 7], 0, ids)])
        return torch.cat([runner.step([fg.SeqChunk([t], 4 + i, ids)]).logits for i, t in enumerate((3, 11))])

    want = decode_logits()
    rows = []
    monkeypatch.setattr(Linear, "uses_kernel", lambda self, x: rows.append(x.shape[0]) or x.shape[0] == 1)
    got = decode_logits()
    assert 1 in rows and max(rows) > 1          # both paths were taken (prefill rows > 1, decode one row)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
