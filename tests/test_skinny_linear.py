"""The split-K weight-streaming linear for 2-64 rows (``kernels.skinny_linear``) against float64
references: ragged and even sizes, every split count, bias, the gated activations, the RMSNorm on
load and the residual epilogue; a NaN-poisoned workspace, the arrival counters back at zero, the
op's dispatch and the refusals."""
from __future__ import annotations

import pytest
import torch

import fullgraph.env
from fullgraph.kernels import skinny_linear
from fullgraph.kernels.linear import linear
from fullgraph.kernels.skinny_linear import WORKSPACE, launch, launch_config, launch_rope_kv
from test_linear_kernel import bf16_case, ref_linear
from test_linear_rope_kv import HEAD_DIM, HEADS, assert_cache, inputs, ref_args, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned_workspace(floats: int = 1 << 16, sums: int = 1 << 12, counters: int = 64):
    """The device's workspace, its partials and sums NaN (a read of a partial nobody wrote shows)."""
    part, ss, counts = WORKSPACE.get(torch.device(DEVICE), floats, sums, counters)
    part.fill_(float("nan"))
    ss.fill_(float("nan"))
    return counts


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("split", [1, 3, 4])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_and_mul", "gegelu"])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_reference(rows, split, epilogue, norm):
    """N = 44 over blocks of 16 and K = 97 over tiles of 32 (both overhang), K split 1, 3 or 4 ways
    (the last split short), bias on every other case."""
    gen = torch.Generator(DEVICE).manual_seed(rows * 100 + split)
    n, k = 44, 97
    x = 3 * torch.randn(2 * rows, k, device=DEVICE, generator=gen)[::2] + 0.5      # strided rows
    w = torch.randn(n, k, device=DEVICE, generator=gen)
    b = torch.randn(n, device=DEVICE, generator=gen) if (rows + split) % 2 else None
    g = 1 + 0.3 * torch.randn(k, device=DEVICE, generator=gen) if norm else None
    residual = torch.randn(rows, n, device=DEVICE, generator=gen) if epilogue == "residual" else None
    activation = epilogue if epilogue != "residual" else "none"
    counts = poisoned_workspace()
    got = launch(x, w, b, activation, 1.5, (16, 32, split, 4, 1), g, 1e-5, residual)
    want = ref_linear(x, w, b, activation, 1.5, g, 1e-5, residual)
    assert got.shape == want.shape and got.dtype == x.dtype
    # float32 sums of ~30-sized products in another order: errors scale with the largest output
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * float(want.abs().max()))
    assert int(counts.count_nonzero()) == 0, "an arrival counter was left set"


@pytest.mark.parametrize("rows", [3, 32, 64])
def test_even_blocks_take_the_unmasked_loads(rows):
    """N and K multiples of their blocks (the loads without masks), 64 rows at most."""
    gen = torch.Generator(DEVICE).manual_seed(rows)
    n, k = 64, 256
    x, w = torch.randn(rows, k, device=DEVICE, generator=gen), torch.randn(n, k, device=DEVICE, generator=gen)
    g = 1 + 0.3 * torch.randn(k, device=DEVICE, generator=gen)
    poisoned_workspace()
    for cfg in ((32, 64, 1, 4, 1), (32, 64, 2, 4, 1), (16, 32, 8, 4, 1)):
        torch.testing.assert_close(launch(x, w, None, config=cfg, norm_weight=g, eps=1e-6).double(),
                                   ref_linear(x, w, None, norm_weight=g, eps=1e-6), rtol=1e-5, atol=1e-4)


def test_repeated_calls_are_identical_and_leave_the_counters_at_zero():
    """Partials are summed in split order by whichever program arrives last: the same bits every call."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    x, w = torch.randn(6, 200, device=DEVICE, generator=gen), torch.randn(40, 200, device=DEVICE, generator=gen)
    counts = poisoned_workspace()
    first = launch(x, w, None, config=(8, 32, 4, 4, 1))
    for _ in range(3):
        assert torch.equal(launch(x, w, None, config=(8, 32, 4, 4, 1)), first)
    assert int(counts.count_nonzero()) == 0


def test_launch_config_fills_the_sms_about_once_with_a_k_tile_a_split_at_least():
    # llama-1b o_proj (2048 x 2048): 32 column blocks of 64, K split 4 ways (128 programs, >= 0.7 an SM)
    assert launch_config(32, 2048, 2048, num_sms=132)[:3] == (64, 128, 4)
    # its QKV (3072 x 2048): 48 blocks, 2 splits (96 programs) plain; normed on load, 64-long K tiles, 4 splits
    assert launch_config(32, 3072, 2048, num_sms=132)[:3] == (64, 128, 2)
    assert launch_config(32, 3072, 2048, num_sms=132, norm=True)[:3] == (64, 64, 4)
    # gate_up of llama-1b (16384 columns: 256 blocks of 64) and Llama-8B (28672: 224 blocks of 128): no split
    assert launch_config(32, 16384, 2048, num_sms=132)[:3] == (64, 128, 1)
    assert launch_config(32, 28672, 4096, num_sms=132)[:3] == (128, 128, 1)
    # a short K splits only while every split keeps a K tile: SmolLM2's o_proj (576 x 576) 4 ways, not 16
    assert launch_config(32, 576, 576, num_sms=132)[2] == 4
    assert launch_config(16, 576, 100, num_sms=132)[2] == 1
    assert launch_config(64, 2048, 2048)[1] == 64     # 64 rows: half the K tile (shared memory)


def test_the_op_dispatches_to_it_when_chosen(monkeypatch):
    gen = torch.Generator(DEVICE).manual_seed(4)
    x, w = torch.randn(4, 48, device=DEVICE, generator=gen), torch.randn(24, 48, device=DEVICE, generator=gen)
    g, residual = 1 + 0.2 * torch.randn(48, device=DEVICE, generator=gen), torch.randn(4, 24, device=DEVICE, generator=gen)
    calls = []
    real = skinny_linear.launch
    monkeypatch.setattr(skinny_linear, "launch", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "skinny")
    got = linear(x, w, None, "none", norm_weight=g, eps=1e-5, residual=residual)
    torch.testing.assert_close(got.double(), ref_linear(x, w, None, norm_weight=g, eps=1e-5, residual=residual),
                               rtol=1e-5, atol=1e-4)
    linear(x[:2], w)
    linear(x[:1], w)                                   # one row keeps the one-row kernel, even so
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "auto")
    linear(x, w)                                       # auto: the split-K kernel on CUDA, the tl.dot path under the interpreter
    linear(x[:1], w)                                   # auto, one row: the one-row kernel
    assert calls == [4, 2] + ([4] if x.is_cuda else [])


def test_refusals_name_the_problem():
    x, w = torch.randn(4, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="0 rows; it serves 1 .. 64"):
        launch(x[:0], w, None)
    with pytest.raises(ValueError, match="65 rows"):
        launch(torch.randn(65, 16, device=DEVICE), w, None)
    with pytest.raises(ValueError, match="even BLOCK_N"):
        launch(x, w, None, "silu_and_mul", config=(5, 16, 1, 4, 1))
    with pytest.raises(ValueError, match="contiguous"):
        launch(x, w.t().contiguous().t(), None)



@pytest.mark.parametrize("config", [(8, 32, 1, 4, 1), (8, 32, 3, 4, 1), (32, 16, 4, 4, 1)], ids=["bn8", "split3", "bn32-split4"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_rope_kv_matches_the_float64_reference(layout, rows, norm, config):
    """``launch_rope_kv``: the QKV projection (its column pairs, split K included) with RoPE on q and
    k and the paged KV write; a padded row (slot -1) writes nothing and its q row is zeros; every
    cache element outside the written slots keeps its bits."""
    args = inputs(rows, layout, bias=rows > 1, norm=norm, seed=rows * 8 + norm * 2 + config[2])
    before = args["kv_cache"].clone()
    counts = poisoned_workspace()
    q_out = launch_rope_kv(**args, config=config)
    assert q_out.shape == (rows, HEADS, HEAD_DIM) and q_out.dtype == args["x"].dtype
    want_q, want_cache = reference(**ref_args(args, before))
    torch.testing.assert_close(q_out.double(), want_q, rtol=1e-5, atol=1e-5)
    if rows > 1:
        assert not q_out[2].any(), "a padded row's q_out is zeros"
    assert_cache(args["kv_cache"], before, want_cache, args["slot_mapping"])
    assert int(counts.count_nonzero()) == 0


def test_rope_kv_refuses_odd_column_blocks():
    args = inputs(3, "llama", bias=False, norm=False, seed=1)
    with pytest.raises(ValueError, match="power of 2 >= 2"):
        launch_rope_kv(**args, config=(6, 32, 1, 4, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,rows", [(3072, 2048, 1), (3072, 2048, 64), (2048, 8192, 32), (28672, 4096, 2),
                                      (28672, 4096, 32)])   # one row, 64 (half the K tile), split K, wide
@pytest.mark.parametrize("fused", ["", "norm+silu", "norm+residual"])
def test_bf16_model_shapes_flash_rule(n, k, rows, fused):
    """bf16 at model shapes with the default configuration (splits and all) against float64, within
    twice the error of PyTorch's own bf16 pipeline (+ slack); counters back at zero; the same bits
    inside a CUDA graph's replays."""
    activation = "silu_and_mul" if "silu" in fused else "none"
    (x, w, b, g, res), want, base = bf16_case(n, k, rows, activation, bool(fused), "residual" in fused)
    got = launch(x, w, b, activation, 20.0, None, g, 1e-5, res)
    assert (got.double() - want).abs().max().item() <= 2 * base + 1e-3
    counts = WORKSPACE.buffers[x.device][2]
    assert int(counts.count_nonzero()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = launch(x, w, b, activation, 20.0, None, g, 1e-5, res)
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(replayed, got, rtol=0, atol=0)
    assert int(counts.count_nonzero()) == 0
