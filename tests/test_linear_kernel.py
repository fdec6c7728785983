"""The weight-streaming linear kernel (``fullgraph::linear``) against float64 references:
one row and several, ragged sizes, bias, the fused gated activations, the RMSNorm (and, one row,
the LayerNorm) on load and the residual epilogue, weight tiles prefetched before the wait, the
cuBLAS form it is measured against, and the models' use of it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fullgraph.env
import fullgraph.kernels
from fullgraph.attention import Attention
from fullgraph.kernels import linear_choice
from fullgraph.kernels.linear import NO_LIMIT, launch, launch_config, layer_norm_sums, linear
from fullgraph.models.layers import Linear, PreNormDecoderLayer, fused_max_rows, kernel_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ref_linear(x, w, b, activation="none", limit=NO_LIMIT, norm_weight=None, eps=1e-5, residual=None):
    x = x.double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = x @ w.double().t() + (0 if b is None else b.double())
    if residual is not None:
        return y + residual.double()
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


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_and_mul", "gegelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_on_load_matches_reference(rows, prefetch, epilogue, bias):
    """norm(x) @ w.T (+ b), then the activation or + residual: K of 97 over tiles of 32 (a ragged
    last tile; with prefetch 2 the second tile is loaded before the wait), 44 columns over blocks of 8."""
    n, k = 44, 97
    x = 3 * torch.randn(2 * rows, k, device=DEVICE)[::2] + 0.5     # strided rows, far from unit rms
    w, b = torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE) if bias else None
    g = 1 + 0.3 * torch.randn(k, device=DEVICE)
    residual = torch.randn(rows, n, device=DEVICE) if epilogue == "residual" else None
    activation = epilogue if epilogue != "residual" else "none"
    got = launch(x, w, b, activation, 1.5, (8, 32, 4, prefetch), g, 1e-5, residual)
    want = ref_linear(x, w, b, activation, 1.5, g, 1e-5, residual)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_and_mul", "gegelu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("offset", [0.5, 40.0], ids=["centred", "far-off-centre"])
def test_layer_norm_on_load_matches_reference(prefetch, epilogue, bias, offset):
    """One row, a LayerNorm (weight and bias) applied on load: K of 97 over tiles of 32, 44 columns
    over blocks of 8. A row whose mean (40) is far above its spread (3) is where plain float32
    sums of x and x*x would cancel: the kernel sums x - x[0]."""
    n, k = 44, 97
    gen = torch.Generator().manual_seed(int(offset) + 3 * bias + prefetch)
    x = (3 * torch.randn(1, k, generator=gen) + offset).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    g, nb = (1 + 0.3 * torch.randn(k, generator=gen)).to(DEVICE), (0.5 * torch.randn(k, generator=gen)).to(DEVICE)
    residual = torch.randn(1, n, generator=gen).to(DEVICE) if epilogue == "residual" else None
    activation = epilogue if epilogue != "residual" else "none"
    sums = layer_norm_sums(w, g, nb)
    got = launch(x, w, b, activation, 1.5, (8, 32, 4, prefetch), g, 1e-5, residual, sums)
    xn = F.layer_norm(x.double(), (k,), g.double(), nb.double(), 1e-5)
    want = ref_linear(xn, w, b, activation, 1.5, None, 1e-5, residual)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    if epilogue == "none":   # the op takes the one-row kernel too (its own launch configuration)
        torch.testing.assert_close(linear(x, w, b, norm_weight=g, eps=1e-5, layer_norm_sums=sums).double(), want,
                                   rtol=1e-5, atol=1e-4)


def test_layer_norm_on_load_is_refused_where_it_does_not_serve():
    """A LayerNorm on load serves one row, with its weight and float32 (N, 2) sums: other calls
    are refused by name."""
    k = 16
    x, w, g = torch.randn(2, k), torch.randn(8, k), torch.ones(k)
    sums = layer_norm_sums(w, g, torch.randn(k))
    with pytest.raises(ValueError, match="needs one row"):
        launch(x, w, None, norm_weight=g, layer_norm_sums=sums)
    with pytest.raises(ValueError, match="needs one row"):
        launch(x[:1], w, None, layer_norm_sums=sums)
    for bad in (sums[:-1], sums.double(), sums.t().contiguous().t()):
        with pytest.raises(ValueError, match="needs one row"):
            launch(x[:1], w, None, norm_weight=g, layer_norm_sums=bad)


def test_layer_norm_sums_are_each_weight_rows_sums_in_float64():
    """``layer_norm_sums`` over more rows than one chunk of it (4,096): (w @ g, w @ b) per row."""
    gen = torch.Generator().manual_seed(5)
    w, g, nb = torch.randn(4100, 24, generator=gen), torch.randn(24, generator=gen), torch.randn(24, generator=gen)
    got = layer_norm_sums(w.bfloat16(), g, nb)
    assert got.shape == (4100, 2) and got.dtype == torch.float32 and got.is_contiguous()
    want = torch.stack((w.bfloat16().double() @ g.double(), w.bfloat16().double() @ nb.double()), dim=1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_and_mul", "residual+bias"])
def test_the_cublas_form_computes_the_same(epilogue):
    """``linear_choice.unfused`` (the norm kernel, cuBLAS, the activation kernel, the add) is what
    our fused kernel computes, so measuring one against the other chooses between equals."""
    m, n, k = 5, 24, 40
    x, w, g = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE), 1 + 0.2 * torch.randn(k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if epilogue.endswith("bias") else None
    residual = torch.randn(m, n, device=DEVICE) if epilogue.startswith("residual") else None
    activation = "silu_and_mul" if epilogue == "silu_and_mul" else "none"
    got = linear_choice.unfused(x, w, b, activation, NO_LIMIT, g, 1e-6, residual)
    torch.testing.assert_close(got.double(), ref_linear(x, w, b, activation, NO_LIMIT, g, 1e-6, residual),
                               rtol=1e-5, atol=1e-4)


def test_the_choice_follows_the_environment_and_sends_prefill_to_cublas(monkeypatch):
    x = torch.randn(linear_choice.MAX_ROWS, 8, device=DEVICE)
    few, many = linear_choice.SKINNY_ROWS, linear_choice.SKINNY_ROWS + 1   # auto's last split-K step and the next
    for impl, want_few, want_many, fuse_rows in (
            ("triton", "triton", "triton", 1), ("skinny", "skinny", "skinny", linear_choice.MAX_ROWS),
            ("cublas", "cublas", "cublas", 1),
            ("auto", "skinny" if x.is_cuda else "triton", "cublas" if x.is_cuda else "triton", linear_choice.SKINNY_ROWS),
            ("timed", "skinny" if x.is_cuda else "triton", "cublas" if x.is_cuda else "triton", linear_choice.SKINNY_ROWS)):
        monkeypatch.setattr(fullgraph.env, "linear_impl", lambda impl=impl: impl)
        assert (linear_choice.choose(x[:2]), linear_choice.choose(x[:few])) == (want_few, want_few), impl
        assert linear_choice.choose(x[:many]) == linear_choice.choose(x) == want_many, impl
        assert linear_choice.choose(x[:1]) == "triton"   # one row: the one-row kernel, whatever the setting
        assert linear_choice.choose(torch.randn(linear_choice.MAX_ROWS + 1, 8, device=DEVICE)) == "cublas"
        # on CUDA the layers fuse exactly the steps whose linears take the one-row or the split-K kernel
        assert linear_choice.max_skinny_rows() == fuse_rows, impl
        half = x.to(torch.bfloat16)
        for rows in (1, 2, few, many, linear_choice.MAX_ROWS):
            fusing = half.is_cuda and (rows == 1 or linear_choice.choose(half[:rows]) == "skinny")
            assert kernel_path(half[:rows], fused_max_rows()) == fusing, (impl, rows)


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
    norm, residual = fg_rms_norm(16), torch.randn(1, 8)
    torch.testing.assert_close(lin(one, norm, residual), F.linear(norm(one), lin.weight, lin.bias) + residual)
    with pytest.raises(ValueError, match="activation"):
        lin(one, activation="silu_and_mul")
    if torch.cuda.is_available():
        lin = lin.to("cuda", torch.bfloat16)
        one = one.to("cuda", torch.bfloat16)
        assert lin.uses_kernel(one)
        assert not lin.uses_kernel(torch.randn(2, 16, device="cuda", dtype=torch.bfloat16))
        assert not lin.uses_kernel(one.float())


def fg_rms_norm(n):
    from fullgraph.models.layers import RMSNorm

    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    return norm


def bf16_case(n: int, k: int, rows: int, activation: str, norm: bool, residual: bool):
    """Random bf16 inputs of a linear at a model shape, (x, w, b, norm weight, residual); its float64
    reference (GeGeLU limit 20); and the largest error of PyTorch's own bf16 pipeline (RMSNorm in
    bf16, cuBLAS, the activation, the add) against it: the flash-attention rule's baseline."""
    gen = torch.Generator("cuda").manual_seed(rows)
    x = (2 * torch.randn(rows, k, device="cuda", generator=gen) + 0.3).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    b = (0.02 * torch.randn(n, device="cuda", generator=gen)).bfloat16()
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).bfloat16() if norm else None
    res = torch.randn(rows, n, device="cuda", generator=gen).bfloat16() if residual else None
    want = ref_linear(x, w, b, activation, 20.0, g, 1e-5, res)
    xn = x if g is None else (g * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16())
    torch_bf16 = F.linear(xn, w, b)
    if activation != "none":
        torch_bf16 = torch.ops.fullgraph.gegelu(torch_bf16, 20.0) if activation == "gegelu" \
            else torch.ops.fullgraph.silu_and_mul(torch_bf16)
    if res is not None:
        torch_bf16 = torch_bf16 + res
    return (x, w, b, g, res), want, (torch_bf16.double() - want).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(3072, 2048), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("activation", ["none", "gegelu", "silu_and_mul"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("fused", ["", "norm", "norm+residual"])
def test_bf16_model_shapes_flash_rule(n, k, activation, rows, fused):
    """bf16 against float64, within twice the error of PyTorch's own bf16 pipeline (RMSNorm in
    bf16, cuBLAS, the activation, the add) (+ slack); ours launched directly, whatever the choice."""
    if "residual" in fused and activation != "none":
        pytest.skip("the residual epilogue has no activation")
    (x, w, b, g, res), want, base = bf16_case(n, k, rows, activation, bool(fused), "residual" in fused)
    got = launch(x, w, b, activation, 20.0, None, g, 1e-5, res)
    assert (got.double() - want).abs().max().item() <= 2 * base + 1e-3
    torch.testing.assert_close(linear(x, w, b, activation, 20.0, g, 1e-5, res).double(), want,
                               rtol=0, atol=2 * base + 1e-3)  # the op: ours or cuBLAS, whichever it chose


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(12288, 4096), (28672, 4096), (4096, 4096)])   # Phi-3-Small's QKV, gate_up, o
@pytest.mark.parametrize("activation", ["none", "gegelu"])
def test_bf16_layer_norm_on_load_flash_rule(n, k, activation):
    """One bf16 row with a LayerNorm applied on load against float64, within twice the error of
    PyTorch's bf16 pipeline (F.layer_norm, cuBLAS, the activation) (+ slack); the row's mean far
    from zero, as a residual stream's can be."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = (torch.randn(1, k, device="cuda", generator=gen) + 3.0).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    b = (0.02 * torch.randn(n, device="cuda", generator=gen)).bfloat16()
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    nb = (0.1 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    want = ref_linear(F.layer_norm(x.double(), (k,), g.double(), nb.double(), 1e-5), w, b, activation, 20.0)
    torch_bf16 = F.linear(F.layer_norm(x, (k,), g, nb, 1e-5), w, b)
    if activation == "gegelu":
        torch_bf16 = torch.ops.fullgraph.gegelu(torch_bf16, 20.0)
    base = (torch_bf16.double() - want).abs().max().item()
    got = linear(x, w, b, activation, 20.0, g, 1e-5, None, layer_norm_sums(w, g, nb))
    assert (got.double() - want).abs().max().item() <= 2 * base + 1e-3


@pytest.mark.parametrize("fuse", ["", "layer,rope", "layer,rope,layernorm"], ids=["separate", "fused", "layernorm"])
@pytest.mark.parametrize("rows", ["one", "all", "all-skinny"])
@pytest.mark.parametrize("preset", ["llama", "phi3"])
def test_models_on_the_kernel_path_match_the_separate_ops(monkeypatch, preset, rows, fuse):
    """Force the kernel path (the one every CUDA batch-1 step takes: projection and activation in
    one launch; with ``FULLGRAPH_FUSE=layer,rope`` also the RMSNorm on load, the residual add in the
    epilogue, RoPE and the KV write in the QKV projection; with ``layernorm`` Phi-3-Small's
    LayerNorms on load in one-row steps) on the CPU through the Triton interpreter, for one-row
    steps or every step: the logits match the plain PyTorch path."""
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
    if rows == "all-skinny":  # more than one row: the split-K kernel (its rope fusion: two launches)
        monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "skinny")
        rows = "all"
    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset(filter(None, fuse.split(","))))
    seen, fused = [], []
    monkeypatch.setattr(Linear, "uses_kernel", lambda self, x: seen.append(x.shape[0]) or rows == "all" or x.shape[0] == 1)
    # on the CPU the rotation never fuses (RotaryEmbedding.fusable): say it may, where switched on
    monkeypatch.setattr(Attention, "projection_writes", lambda self, metadata, rope, x: bool(fuse))
    monkeypatch.setattr(PreNormDecoderLayer, "fuses", lambda self, x: self.fuse and (rows == "all" or x.shape[0] == 1))
    real = fullgraph.kernels.linear_rope_kv_write
    monkeypatch.setattr(fullgraph.kernels, "linear_rope_kv_write", lambda x, *a: fused.append(x.shape[0]) or real(x, *a))
    real_linear, on_load = fullgraph.kernels.linear, []    # rows of each call given a LayerNorm to apply on load
    monkeypatch.setattr(fullgraph.kernels, "linear",
                        lambda x, *a: (a[-1] is not None and on_load.append(x.shape[0])) or real_linear(x, *a))
    got = decode_logits()
    assert 1 in seen and max(seen) > 1          # both paths were taken (prefill rows > 1, decode one row)
    assert sorted(set(fused)) == ([] if not fuse else [1] if rows == "one" else [1, 4])
    assert set(on_load) == ({1} if preset == "phi3" and "layernorm" in fuse else set()), "one-row steps only"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_fused_layer_flow_is_the_same_function_in_float32(monkeypatch):
    """``FULLGRAPH_FUSE=layer`` on the plain PyTorch path (CPU, float32): the layers carry the summed
    stream instead of (output, residual), and the logits are bit-identical."""
    import fullgraph as fg

    def logits():
        runner = fg.FullGraphRunner(fg.models.Llama(fg.models.LlamaConfig.toy()), max_num_seqs=2, max_num_tokens=32,
                                    max_model_len=128, cudagraph="none", attention="sdpa")
        ids = runner.blocks.allocate(2)
        return torch.cat([runner.step([fg.SeqChunk([5, 9, 2, 7], 0, ids)]).logits,
                          runner.step([fg.SeqChunk([3], 4, ids)]).logits])

    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset())
    want = logits()
    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset({"layer"}))
    flows = []
    monkeypatch.setattr(PreNormDecoderLayer, "fuses", lambda self, x: flows.append(self.fuse) or self.fuse)
    assert torch.equal(logits(), want)
    assert flows and all(flows)           # every layer of every step took the fused flow


def test_pdl_switch_is_validated(monkeypatch):
    try:
        for value, late in (("early", False), ("late", True), ("1", True), ("0", True)):
            monkeypatch.setenv(fullgraph.env.PDL, value)
            fullgraph.env.pdl_late.cache_clear()
            assert fullgraph.env.pdl_late() is late
        monkeypatch.setenv(fullgraph.env.PDL, "sometimes")
        fullgraph.env.pdl_late.cache_clear()
        with pytest.raises(ValueError, match="FULLGRAPH_PDL"):
            fullgraph.env.pdl_late()
    finally:
        monkeypatch.delenv(fullgraph.env.PDL)
        fullgraph.env.pdl_late.cache_clear()


def test_fuse_switch_is_validated(monkeypatch):
    monkeypatch.setenv(fullgraph.env.FUSE, "layer,bogus")
    fullgraph.env.fused.cache_clear()
    try:
        with pytest.raises(ValueError, match="FULLGRAPH_FUSE"):
            fullgraph.env.fused()
        monkeypatch.setenv(fullgraph.env.FUSE, "layer,reduce")
        fullgraph.env.fused.cache_clear()
        assert fullgraph.env.fused() == {"layer", "reduce"}
        for value, want in (("none", set()), ("", set())):
            monkeypatch.setenv(fullgraph.env.FUSE, value)
            fullgraph.env.fused.cache_clear()
            assert fullgraph.env.fused() == want
        monkeypatch.delenv(fullgraph.env.FUSE)
        fullgraph.env.fused.cache_clear()
        assert fullgraph.env.fused() == {"layer", "rope"}       # the default: the one-row fusions
    finally:
        monkeypatch.setenv(fullgraph.env.FUSE, "")
        monkeypatch.delenv(fullgraph.env.FUSE)
        fullgraph.env.fused.cache_clear()


def test_linear_switch_defaults_to_timed_and_is_validated(monkeypatch):
    """Unset, ``FULLGRAPH_LINEAR`` is ``timed`` (each captured size of 2-32 rows recorded in both forms,
    the faster kept); every named setting is taken as given, anything else refused by name."""
    try:
        monkeypatch.delenv(fullgraph.env.LINEAR, raising=False)
        fullgraph.env.linear_impl.cache_clear()
        assert fullgraph.env.linear_impl() == "timed"
        assert linear_choice.tunable(8, torch.bfloat16) and not linear_choice.tunable(1, torch.bfloat16)
        for value in ("auto", "timed", "skinny", "cublas", "triton"):
            monkeypatch.setenv(fullgraph.env.LINEAR, value)
            fullgraph.env.linear_impl.cache_clear()
            assert fullgraph.env.linear_impl() == value
        monkeypatch.setenv(fullgraph.env.LINEAR, "fastest")
        fullgraph.env.linear_impl.cache_clear()
        with pytest.raises(ValueError, match="FULLGRAPH_LINEAR='fastest'"):
            fullgraph.env.linear_impl()
    finally:
        monkeypatch.delenv(fullgraph.env.LINEAR, raising=False)
        fullgraph.env.linear_impl.cache_clear()
