"""``linear_rope_kv_write`` (the QKV projection with RoPE and the paged KV-cache write fused into
its epilogue) against a float64 reference and against the two launches it replaces
(``linear.launch`` then ``rope_kv_write``): both QKV layouts, one row and several (a padded
slot, a slot mapping shorter than the rows), bias, RMSNorm on load, prefetch 1 and 2, a K that
is ragged against the K block; the whole cache is compared, NaN-poisoned pages bit for bit.
CPU: ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fullgraph.kernels import rope_kv_write
from fullgraph.kernels.linear import launch as linear_launch
from fullgraph.kernels.linear import layer_norm_sums
from fullgraph.kernels.linear_rope_kv import launch, linear_rope_kv_write

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")
HEADS, KV_HEADS, HEAD_DIM, K, PAGE, BLOCKS, MAX_POS = 4, 2, 16, 40, 4, 8, 64


def head_blocks(y: torch.Tensor, heads: int, kv_heads: int, layout: str):
    """q (T, H, D), k, v (T, KVH, D) of a projection y (T, (H + 2 KVH) D) in ``layout``."""
    t, d = y.shape[0], y.shape[1] // (heads + 2 * kv_heads)
    if layout == "grouped":
        g = heads // kv_heads
        y = y.view(t, kv_heads, g + 2, d)
        return y[:, :, :g].reshape(t, heads, d), y[:, :, g], y[:, :, g + 1]
    q, k, v = y.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    return q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)


def reference(x, w, b, g, eps, cache, slots, positions, cos, sin, heads, kv_heads, layout):
    """float64: (q_out, the cache after the write)."""
    x = x.double()
    if g is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    y = x @ w.double().t() + (0 if b is None else b.double())
    q, k, v = head_blocks(y, heads, kv_heads, layout)
    q_out, k_rot = rotate(q, positions, cos, sin), rotate(k, positions, cos, sin)
    want = cache.double()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[0, slot // cache.shape[2], slot % cache.shape[2]] = k_rot[t]
            want[1, slot // cache.shape[2], slot % cache.shape[2]] = v[t]
        else:
            q_out[t] = 0
    return q_out, want


def inputs(rows: int, layout: str, bias: bool, norm: bool, seed: int, heads: int = HEADS, kv_heads: int = KV_HEADS,
           head_dim: int = HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv_heads) * head_dim
    x = 2 * torch.randn(rows, K, generator=gen) + 0.3
    w = torch.randn(n, K, generator=gen) / K ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    g = 1 + 0.3 * torch.randn(K, generator=gen) if norm else None
    angles = torch.rand(MAX_POS, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = (angles.cos() * 1.2).float(), (angles.sin() * 1.2).float()
    positions = torch.randint(0, MAX_POS, (rows,), generator=gen)
    written = torch.randperm((BLOCKS - 1) * PAGE, generator=gen)[:rows] + PAGE        # never the null block 0
    slots = written if rows == 1 else torch.cat((written[:2], torch.tensor([-1]), written[3: rows - 1]))  # S = T - 1
    cache = torch.randn(2, BLOCKS, PAGE, kv_heads, head_dim, generator=gen)
    cache[:, 0] = NAN                                                                 # the null block
    cache[:, BLOCKS - 2:] = NAN                                                       # unused blocks
    to = lambda t: None if t is None else t.to(DEVICE)                                # noqa: E731
    return dict(x=to(x), w=to(w), b=to(b), norm_weight=to(g), eps=1e-5, kv_cache=to(cache), slot_mapping=to(slots),
                positions=to(positions), cos=to(cos), sin=to(sin), num_heads=heads, num_kv_heads=kv_heads,
                layout=layout)


def ref_args(args: dict, before: torch.Tensor) -> dict:
    return dict(x=args["x"], w=args["w"], b=args["b"], g=args["norm_weight"], eps=args["eps"], cache=before,
                slots=args["slot_mapping"], positions=args["positions"], cos=args["cos"], sin=args["sin"],
                heads=args["num_heads"], kv_heads=args["num_kv_heads"], layout=args["layout"])


def assert_cache(got: torch.Tensor, before: torch.Tensor, want: torch.Tensor, slots: torch.Tensor) -> None:
    """Written slots close to ``want``; every other element bit-identical to ``before``."""
    flat_got, flat_before = got.flatten(1, 2), before.flatten(1, 2)
    live = slots[slots >= 0]
    torch.testing.assert_close(flat_got[:, live].double(), want.flatten(1, 2)[:, live],
                               rtol=1e-5, atol=1e-5)
    untouched = torch.ones(flat_got.shape[1], dtype=torch.bool, device=got.device)
    untouched[live] = False
    assert untouched.sum() == flat_got.shape[1] - len(live)
    assert torch.equal(flat_got[:, untouched].view(torch.int32), flat_before[:, untouched].view(torch.int32)), \
        "cache elements outside the written slots changed"


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_matches_float64_reference(layout, rows, bias, norm, prefetch):
    args = inputs(rows, layout, bias, norm, seed=rows * 16 + bias * 4 + norm * 2 + prefetch)
    before = args["kv_cache"].clone()
    config = (4, 32, 4, prefetch) if rows == 1 else (8, 32, 4, prefetch)
    q_out = launch(**args, config=config)
    assert q_out.shape == (rows, HEADS, HEAD_DIM) and q_out.dtype == args["x"].dtype and q_out.is_contiguous()
    want_q, want_cache = reference(**ref_args(args, before))
    torch.testing.assert_close(q_out.double(), want_q, rtol=1e-5, atol=1e-5)
    if rows > 1:
        assert not q_out[2].any(), "a padded row's q_out is zeros"
        assert q_out[rows - 1].abs().sum() > 0, "a row past the slot mapping is still rotated"
    assert_cache(args["kv_cache"], before, want_cache, args["slot_mapping"])


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_layer_norm_on_load_matches_float64_reference(layout, prefetch):
    """One row with a LayerNorm (weight and bias) applied on load: q rotated, k and v written."""
    args = inputs(1, layout, True, True, seed=90 + prefetch)
    gen = torch.Generator().manual_seed(7 + prefetch)
    nb = (0.5 * torch.randn(K, generator=gen)).to(DEVICE)
    before = args["kv_cache"].clone()
    sums = layer_norm_sums(args["w"], args["norm_weight"], nb)
    q_out = launch(**args, config=(4, 32, 4, prefetch), layer_norm_sums=sums)
    ref = ref_args(args, before)
    ref.update(x=F.layer_norm(args["x"].double(), (K,), args["norm_weight"].double(), nb.double(), args["eps"]),
               g=None)
    want_q, want_cache = reference(**ref)
    torch.testing.assert_close(q_out.double(), want_q, rtol=1e-5, atol=1e-5)
    assert_cache(args["kv_cache"], before, want_cache, args["slot_mapping"])
    again = args["kv_cache"].clone()
    args["kv_cache"] = again
    torch.testing.assert_close(linear_rope_kv_write(**args, layer_norm_sums=sums).double(), want_q, rtol=1e-5,
                               atol=1e-5)


def two_launches(args: dict, config: tuple[int, ...] | None) -> torch.Tensor:
    """``linear.launch`` then ``rope_kv_write`` on views of the (T, N) projection: what the fusion replaces."""
    y = linear_launch(args["x"], args["w"], args["b"], config=config, norm_weight=args["norm_weight"], eps=args["eps"])
    t, heads, kv_heads = y.shape[0], args["num_heads"], args["num_kv_heads"]
    if args["layout"] == "grouped":
        g = heads // kv_heads
        view = y.view(t, kv_heads, g + 2, -1)
        q, k, v = view[:, :, :g], view[:, :, g], view[:, :, g + 1]
    else:
        q, k, v = head_blocks(y, heads, kv_heads, "llama")
    return rope_kv_write(query=q, key=k, value=v, kv_cache=args["kv_cache"], slot_mapping=args["slot_mapping"],
                         positions=args["positions"], cos=args["cos"], sin=args["sin"])


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_same_as_linear_then_rope_kv_write(layout, rows):
    config = (4, 32, 4, 2) if rows == 1 else (8, 32, 4, 1)
    fused = inputs(rows, layout, bias=True, norm=True, seed=40 + rows)
    twice = {**fused, "kv_cache": fused["kv_cache"].clone()}
    q_fused = launch(**fused, config=config)
    q_twice = two_launches(twice, config)
    torch.testing.assert_close(q_fused, q_twice, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused["kv_cache"], twice["kv_cache"], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("config", [None, (2, 16, 4, 1), (32, 64, 4, 2)], ids=["default", "bn2", "bn32"])
def test_column_blocks_across_heads(config):
    """Column blocks of one pair and of pairs spanning two head blocks (D/2 = 8 pairs a head) give
    the same result as the default configuration's."""
    base = inputs(5, "grouped", bias=True, norm=False, seed=50)
    other = {**base, "kv_cache": base["kv_cache"].clone()}
    before = base["kv_cache"].clone()
    want_q, want_cache = reference(**ref_args(base, before))
    q_out = launch(**other, config=config)
    torch.testing.assert_close(q_out.double(), want_q, rtol=1e-5, atol=1e-5)
    assert_cache(other["kv_cache"], before, want_cache, base["slot_mapping"])


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_ragged_column_blocks(layout, rows):
    """H 3, KVH 1, D 12: 30 pairs over blocks of 4 (the last block half empty), D/2 = 6 pairs a
    head (blocks straddle head blocks), a group of 3 q heads."""
    args = inputs(rows, layout, bias=True, norm=True, seed=55 + rows, heads=3, kv_heads=1, head_dim=12)
    before = args["kv_cache"].clone()
    q_out = launch(**args, config=(8, 32, 4, 2))
    want_q, want_cache = reference(**ref_args(args, before))
    assert q_out.shape == (rows, 3, 12)
    torch.testing.assert_close(q_out.double(), want_q, rtol=1e-5, atol=1e-5)
    assert_cache(args["kv_cache"], before, want_cache, args["slot_mapping"])


def test_all_padding_writes_nothing():
    args = inputs(5, "llama", bias=True, norm=True, seed=60)
    args["slot_mapping"] = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    before = args["kv_cache"].clone()
    q_out = linear_rope_kv_write(**args)
    assert torch.equal(args["kv_cache"].view(torch.int32), before.view(torch.int32))
    assert not q_out.any(), "padded rows' q_out are zeros"


def test_rejects_bad_arguments():
    args = inputs(5, "llama", bias=False, norm=False, seed=70)
    with pytest.raises(ValueError, match="layout"):
        launch(**{**args, "layout": "phi"})
    with pytest.raises(ValueError, match=r"\(H \+ 2 KVH\) \* D"):
        launch(**{**args, "num_heads": 3})
    with pytest.raises(ValueError, match="S <= T"):
        launch(**{**args, "slot_mapping": torch.arange(6, device=DEVICE)})
    with pytest.raises(ValueError, match="float32"):
        launch(**{**args, "cos": args["cos"].double()})
    with pytest.raises(ValueError, match="kv_cache"):
        launch(**{**args, "kv_cache": args["kv_cache"][0]})
    with pytest.raises(ValueError, match="linear_rope_kv_write: linear"):
        launch(**{**args, "w": args["w"][:, :-1]})
    with pytest.raises(ValueError, match="BLOCK_N"):
        launch(**args, config=(6, 32, 4))


def test_opcheck_and_compile_fullgraph():
    args = inputs(5, "grouped", bias=True, norm=True, seed=80)
    order = ("x", "w", "b", "norm_weight", "eps", "kv_cache", "slot_mapping", "positions", "cos", "sin",
             "num_heads", "num_kv_heads", "layout")
    torch.library.opcheck(torch.ops.fullgraph.linear_rope_kv_write.default,
                          tuple(args[k].clone() if k == "kv_cache" else args[k] for k in order))

    def step(x, kv_cache, slot_mapping, positions):
        return linear_rope_kv_write(**{**args, "x": x, "kv_cache": kv_cache, "slot_mapping": slot_mapping,
                                       "positions": positions}) * 2

    eager, compiled = args["kv_cache"].clone(), args["kv_cache"].clone()
    call = (args["slot_mapping"], args["positions"])
    want = step(args["x"], eager, *call)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(args["x"], compiled, *call)
    assert torch.equal(got, want)
    assert torch.equal(compiled.view(torch.int32), eager.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["auto", "skinny"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_gpu_bf16_within_twice_the_two_launch_error(layout, rows, impl, monkeypatch):
    """Against float64: the fused kernel's error at most twice that of the bf16 two-launch pipeline
    (the norm, F.linear in bf16, then ``rope_kv_write``), plus 1e-3, for q and the written cache;
    ``impl`` skinny: 16 rows take the split-K kernel's form of the launch."""
    import fullgraph.env

    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: impl)
    heads, kv_heads, head_dim, k, page, blocks, max_pos = 32, 8, 64, 2048, 16, 64, 4096
    gen = torch.Generator().manual_seed(90 + rows)
    n = (heads + 2 * kv_heads) * head_dim
    bf16 = lambda t: t.to(DEVICE, torch.bfloat16)                                  # noqa: E731
    x, w = bf16(torch.randn(rows, k, generator=gen)), bf16(torch.randn(n, k, generator=gen) / k ** 0.5)
    b, g = bf16(0.1 * torch.randn(n, generator=gen)), bf16(1 + 0.2 * torch.randn(k, generator=gen))
    angles = torch.rand(max_pos, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    slots = (torch.randperm((blocks - 1) * page, generator=gen)[:rows] + page).to(DEVICE)   # never the null block
    positions = torch.randint(0, max_pos, (rows,), generator=gen).to(DEVICE)
    fused = torch.full((2, blocks, page, kv_heads, head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    twice = fused.clone()
    args = dict(x=x, w=w, b=b, norm_weight=g, eps=1e-5, slot_mapping=slots, positions=positions, cos=cos, sin=sin,
                num_heads=heads, num_kv_heads=kv_heads, layout=layout)
    q_out = linear_rope_kv_write(**args, kv_cache=fused)
    want_q, want_cache = reference(**ref_args({**args, "kv_cache": None}, fused.double()))
    xn = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * g
    q, key, value = head_blocks(F.linear(xn, w, b), heads, kv_heads, layout)
    q_twice = rope_kv_write(query=q, key=key, value=value, kv_cache=twice, slot_mapping=slots, positions=positions,
                            cos=cos, sin=sin)
    written = lambda cache: cache.flatten(1, 2)[:, slots]                          # noqa: E731
    for got, base, want in ((q_out, q_twice, want_q), (written(fused), written(twice), written(want_cache))):
        assert torch.isfinite(got).all()
        base_err = (base.double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2 * base_err + 1e-3
    untouched = torch.ones(blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(fused.flatten(1, 2)[:, untouched]).all(), "cache rows outside the written slots changed"


@pytest.mark.parametrize("impl", ["cublas", "skinny"])
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_the_op_with_cublas_chosen_is_the_two_launch_form(layout, impl, monkeypatch):
    """The op for several rows when cuBLAS serves them (forced here: the norm kernel, cuBLAS, then
    ``rope_kv_write``) or the split-K kernel (``skinny_linear.launch_rope_kv``, one launch): it
    computes what the fused launch computes."""
    import fullgraph.env
    from fullgraph.kernels.linear_rope_kv import linear_rope_kv_write

    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: impl)
    fused = inputs(5, layout, bias=True, norm=True, seed=70)
    chosen = {**fused, "kv_cache": fused["kv_cache"].clone()}
    before = fused["kv_cache"].clone()
    q_chosen = linear_rope_kv_write(**chosen)
    want_q, want_cache = reference(**ref_args(fused, before))
    torch.testing.assert_close(q_chosen.double(), want_q, rtol=1e-5, atol=1e-5)
    assert_cache(chosen["kv_cache"], before, want_cache, fused["slot_mapping"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["llama", "grouped"])
def test_gpu_bf16_layer_norm_on_load_within_twice_the_two_launch_error(layout):
    """One bf16 row with a LayerNorm applied on load (Phi-3-Small's QKV shape), against float64:
    q and the written cache within twice the error of F.layer_norm, F.linear in bf16, then
    ``rope_kv_write``, plus 1e-3; the row's mean far from zero."""
    heads, kv_heads, head_dim, k, page, blocks, max_pos = 32, 8, 128, 4096, 16, 64, 4096
    gen = torch.Generator().manual_seed(7)
    n = (heads + 2 * kv_heads) * head_dim
    bf16 = lambda t: t.to(DEVICE, torch.bfloat16)                                  # noqa: E731
    x, w = bf16(torch.randn(1, k, generator=gen) + 3.0), bf16(torch.randn(n, k, generator=gen) / k ** 0.5)
    b, g = bf16(0.1 * torch.randn(n, generator=gen)), bf16(1 + 0.2 * torch.randn(k, generator=gen))
    nb = bf16(0.1 * torch.randn(k, generator=gen))
    angles = torch.rand(max_pos, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    slots = (torch.randperm((blocks - 1) * page, generator=gen)[:1] + page).to(DEVICE)
    positions = torch.randint(0, max_pos, (1,), generator=gen).to(DEVICE)
    fused = torch.full((2, blocks, page, kv_heads, head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    twice = fused.clone()
    args = dict(x=x, w=w, b=b, norm_weight=g, eps=1e-5, slot_mapping=slots, positions=positions, cos=cos, sin=sin,
                num_heads=heads, num_kv_heads=kv_heads, layout=layout)
    q_out = linear_rope_kv_write(**args, kv_cache=fused, layer_norm_sums=layer_norm_sums(w, g, nb))
    ref = ref_args({**args, "kv_cache": None}, fused.double())
    ref.update(x=F.layer_norm(x.double(), (k,), g.double(), nb.double(), 1e-5), g=None)
    want_q, want_cache = reference(**ref)
    q, key, value = head_blocks(F.linear(F.layer_norm(x, (k,), g, nb, 1e-5), w, b), heads, kv_heads, layout)
    q_twice = rope_kv_write(query=q, key=key, value=value, kv_cache=twice, slot_mapping=slots, positions=positions,
                            cos=cos, sin=sin)
    written = lambda cache: cache.flatten(1, 2)[:, slots]                          # noqa: E731
    for got, base, want in ((q_out, q_twice, want_q), (written(fused), written(twice), written(want_cache))):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max().item() <= 2 * (base.double() - want).abs().max().item() + 1e-3
