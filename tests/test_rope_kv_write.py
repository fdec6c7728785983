"""``rope_kv_write`` (RoPE fused into the KV-cache write) and the plumbing that uses it.

The kernel against a float64 reference (rotate-half, then an index copy into the pages), with
NaN-poisoned pages, -1 slots and a q longer than the slot mapping; ``Attention`` with rotary
embeddings on every backend (fused where the backend can, unfused elsewhere, same results); the
toy models through the runner with the fusion forced on the CPU. CPU: ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph.attention import Attention, AttentionMetadata, BlockSparseConfig
from fullgraph.attention.backends import BackendLimits, get_backend_class
from fullgraph.kernels import kv_write, rope, rope_kv_write
from fullgraph.models.layers import RotaryEmbedding, rope_inv_freq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = x.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)


def projection(tokens: int, heads: int, kv_heads: int, head_dim: int, grouped: bool, gen: torch.Generator):
    """q, k, v as views of one fused QKV projection: Llama's [q | k | v] or Phi-3-Small's head-major."""
    if grouped:
        group = heads // kv_heads
        qkv = torch.randn(tokens, kv_heads, group + 2, head_dim, generator=gen).to(DEVICE)
        return qkv[:, :, :group], qkv[:, :, group], qkv[:, :, group + 1]      # (T, KVH, G, D), (T, KVH, D) x2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def tables(head_dim: int, max_pos: int, gen: torch.Generator):
    angles = torch.rand(max_pos, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    return (angles.cos() * 1.3).float().to(DEVICE), (angles.sin() * 1.3).float().to(DEVICE)   # an mscale folded in


def poisoned_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """Random pages, with the null block and every odd block NaN."""
    cache = torch.randn(2, num_blocks, page, kv_heads, head_dim, generator=gen)
    cache[:, ::2] = NAN
    return cache.to(DEVICE)


def expected_cache(before, k_rot, v, slots):
    """float64 reference of the write: an index copy of each real token's rows."""
    want = before.double()
    flat = want.view(2, -1, *want.shape[3:])
    real = slots >= 0
    flat[0, slots[real]], flat[1, slots[real]] = k_rot[: len(slots)][real], v[: len(slots)][real].double()
    return want, real


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * max(1.0, want.abs().max().item()), err


# ---- the kernel ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (6, 1, 80)], ids=["gqa", "mha", "hd80"])
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "grouped"])
def test_matches_rope_then_index_copy(page, heads, kv_heads, head_dim, grouped):
    gen = torch.Generator().manual_seed(page + heads + head_dim + grouped)
    tokens, num_blocks = 11, 6
    q, k, v = projection(tokens, heads, kv_heads, head_dim, grouped, gen)
    written = torch.randperm(num_blocks * page - page, generator=gen)[:6] + page   # never the null block
    slots = torch.cat((written[:3], torch.tensor([-1]), written[3:], torch.tensor([-1]))).to(DEVICE)  # 8 < 11
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(DEVICE)
    cos, sin = tables(head_dim, 100, gen)
    cache = poisoned_cache(num_blocks, page, kv_heads, head_dim, gen)
    before = cache.clone()
    q_out = rope_kv_write(query=q, key=k, value=v, kv_cache=cache, slot_mapping=slots, positions=positions,
                          cos=cos, sin=sin)
    assert q_out.shape == (tokens, heads, head_dim) and q_out.is_contiguous() and q_out.dtype == q.dtype
    want_q = ref_rope(q.reshape(tokens, heads, head_dim), positions, cos, sin)
    padded = torch.zeros(tokens, dtype=torch.bool, device=DEVICE)
    padded[: len(slots)] = slots < 0                                   # slot -1: padding, q_out zeros
    want_q[padded] = 0
    check(q_out, want_q)   # every row: real and past-the-slots rows rotated, padded rows zero
    want, real = expected_cache(before, ref_rope(k, positions, cos, sin), v, slots)
    flat_got, flat_want = cache.view(2, -1, kv_heads, head_dim), want.view(2, -1, kv_heads, head_dim)
    live = slots[real]
    check(flat_got[0, live], flat_want[0, live])
    assert torch.equal(flat_got[1, live], v[: len(slots)][real]), "values must be copied unrotated, exactly"
    untouched = torch.ones(flat_got.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[live] = False
    same = flat_got[:, untouched].view(torch.int32) == before.view(2, -1, kv_heads, head_dim)[:, untouched].view(
        torch.int32)
    assert same.all(), f"{int((~same).sum())} cache elements outside the written slots changed"


def test_negative_slots_leave_the_cache_byte_identical():
    gen = torch.Generator().manual_seed(3)
    q, k, v = projection(5, 4, 2, 64, True, gen)
    q[:], k[:] = NAN, NAN                                         # padding rows: never read
    cache = poisoned_cache(3, 16, 2, 64, gen)
    before = cache.clone()
    positions = torch.randint(0, 20, (5,), generator=gen).to(DEVICE)
    cos, sin = tables(64, 20, gen)
    slots = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    q_out = rope_kv_write(query=q, key=k, value=v, kv_cache=cache, slot_mapping=slots, positions=positions,
                          cos=cos, sin=sin)
    assert torch.equal(cache.view(torch.int32), before.view(torch.int32))
    assert not q_out.any(), "a padded token's q_out row is zeros"


def test_same_as_rope_then_kv_write():
    """The two-launch path it replaces: same rotated q, same cache (NaN pages compared as bytes)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = projection(7, 8, 2, 128, False, gen)
    positions = torch.randint(0, 50, (7,), generator=gen).to(DEVICE)
    cos, sin = tables(128, 50, gen)
    slots = torch.tensor([17, -1, 40, 63, 16, -1], dtype=torch.int64, device=DEVICE)
    fused = poisoned_cache(4, 16, 2, 128, gen)
    twice = fused.clone()
    q_out = rope_kv_write(query=q, key=k, value=v, kv_cache=fused, slot_mapping=slots, positions=positions,
                          cos=cos, sin=sin)
    q_rot, k_rot = rope(q, k, positions, cos, sin)
    kv_write(key=k_rot, value=v, kv_cache=twice, slot_mapping=slots)
    live = torch.tensor([True, False, True, True, True, False, True], device=DEVICE)   # slot -1: padding
    torch.testing.assert_close(q_out[live], q_rot[live], rtol=1e-6, atol=1e-6)
    assert not q_out[~live].any()
    torch.testing.assert_close(fused, twice, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(5)
    q, k, v = projection(4, 4, 2, 32, False, gen)
    cache = torch.zeros(2, 2, 16, 2, 32, device=DEVICE)
    positions, (cos, sin) = torch.zeros(4, dtype=torch.int64, device=DEVICE), tables(32, 8, gen)
    ok = dict(query=q, key=k, value=v, kv_cache=cache, positions=positions, cos=cos, sin=sin)
    with pytest.raises(ValueError, match="S <= T"):
        rope_kv_write(**ok, slot_mapping=torch.arange(5, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        rope_kv_write(**{**ok, "cos": cos.double()}, slot_mapping=torch.arange(4, device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache"):
        rope_kv_write(**{**ok, "kv_cache": cache[:, :, :, :1]}, slot_mapping=torch.arange(4, device=DEVICE))


def test_opcheck_and_compile_fullgraph():
    gen = torch.Generator().manual_seed(6)
    q, k, v = projection(5, 4, 2, 32, True, gen)
    positions = torch.randint(0, 30, (5,), generator=gen).to(DEVICE)
    cos, sin = tables(32, 30, gen)
    slots = torch.tensor([20, -1, 3, 33], dtype=torch.int64, device=DEVICE)
    cache = torch.randn(2, 3, 16, 2, 32, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.fullgraph.rope_kv_write.default, (q, k, v, cache.clone(), slots, positions, cos, sin))

    def step(q, k, v, kv_cache, slots, positions):
        return rope_kv_write(query=q, key=k, value=v, kv_cache=kv_cache, slot_mapping=slots, positions=positions,
                             cos=cos, sin=sin) * 2

    eager, compiled = cache.clone(), cache.clone()
    want = step(q, k, v, eager, slots, positions)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, compiled, slots, positions)
    assert torch.equal(got, want) and torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_within_twice_pytorch_error(dtype):
    gen = torch.Generator().manual_seed(9)
    q, k, v = (t.to(dtype) for t in projection(64, 32, 8, 128, True, gen))
    q = q.reshape(64, 32, 128)
    positions = torch.randint(0, 4096, (64,), generator=gen).to(DEVICE)
    cos, sin = tables(128, 4096, gen)
    slots = (torch.randperm(63 * 16, generator=gen)[:64] + 16).to(DEVICE)
    cache = torch.full((2, 64, 16, 8, 128), NAN, dtype=dtype, device=DEVICE)
    q_out = rope_kv_write(query=q, key=k, value=v, kv_cache=cache, slot_mapping=slots, positions=positions,
                          cos=cos, sin=sin)
    c, s = cos[positions][:, None], sin[positions][:, None]
    for got, x in ((q_out, q), (cache[0].view(-1, 8, 128)[slots], k)):
        x1, x2 = x.float().chunk(2, dim=-1)                        # PyTorch's own same-dtype rotation
        same_dtype = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
        want = ref_rope(x, positions, cos, sin)
        torch_err = (same_dtype.double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2 * torch_err + 1e-3
    assert torch.equal(cache[1].view(-1, 8, 128)[slots], v)


# ---- Attention with a rotary embedding, on every backend ---------------------------------------------
class ForcedRotary(RotaryEmbedding):
    """Says fused kernels may run (on the CPU they otherwise never do) and counts unfused calls."""

    calls = 0

    def fusable(self, x: torch.Tensor) -> bool:
        return True

    def forward(self, positions, q, k):
        self.calls += 1
        return super().forward(positions, q, k)


def attention_steps(backend_name: str, impl: str | None, grouped: bool, rotary: RotaryEmbedding):
    """A prefill step (two requests, one padded token), then a decode step; outputs and the cache."""
    heads, kv_heads, head_dim, page = 4, 2, 32, 16
    sparse = BlockSparseConfig(block_size=16, local_blocks=1, vert_stride=2, num_heads_total=heads)
    kind = "blocksparse" if backend_name == "blocksparse" else "dense"
    layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, kind=kind, sparse=sparse if kind != "dense" else None)
    limits = BackendLimits(4, 64, 128, page, 8, DEVICE, torch.float32)
    extra = {"impl": impl} if impl else {}
    backend = get_backend_class(backend_name)(limits, [layer], **extra)
    cache = torch.full((2, 8, page, kv_heads, head_dim), NAN, device=DEVICE)
    gen, outs = torch.Generator().manual_seed(7), []
    i32 = dict(dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1, 2, 0], [3, 0, 0]], **i32)
    steps = [  # (query_start_loc, seq_lens, slot_mapping, positions, decode_only)
        ([0, 20, 25], [20, 5], list(range(16, 48))[:20] + list(range(48, 53)) + [-1], list(range(20)) + list(range(5)) + [0],
         False),
        ([0, 1, 2], [21, 6], [36, 53], [20, 5], True),
    ]
    for qsl, seq_lens, slots, positions, decode in steps:
        q, k, v = projection(len(slots), heads, kv_heads, head_dim, grouped, gen)
        md = AttentionMetadata(query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
                               block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
                               decode_only=decode, backends={kind: backend})
        out = layer(q, k, v, cache, md, rope=rotary, positions=torch.tensor(positions, device=DEVICE))
        outs.append(out[: qsl[-1]])
    return outs, cache, backend


@pytest.mark.parametrize("backend_name,impl,grouped", [
    ("triton", None, False), ("triton", None, True), ("sdpa", None, True),
    ("blocksparse", "triton", True), ("blocksparse", "torch", False),
], ids=["triton", "triton-grouped", "sdpa", "blocksparse-triton", "blocksparse-torch"])
def test_attention_fuses_only_where_the_writer_can(backend_name, impl, grouped):
    inv_freq = rope_inv_freq(32, 10000.0)
    forced = ForcedRotary(inv_freq, 128, 1.2, device=DEVICE)
    outs, cache, backend = attention_steps(backend_name, impl, grouped, forced)
    fuses = backend.kv_writer.impl == "kernel"
    assert fuses == (backend_name == "triton" or impl == "triton")
    assert forced.calls == (0 if fuses else 2)
    plain = RotaryEmbedding(inv_freq, 128, 1.2, device=DEVICE)       # not fusable on the CPU: rope, then forward
    ref_outs, ref_cache, _ = attention_steps(backend_name, impl, grouped, plain)
    for got, want in zip(outs, ref_outs):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_attention_takes_rope_and_positions_together():
    layer = Attention(2, 1, 16, 0.25)
    with pytest.raises(ValueError, match="together"):
        layer(torch.zeros(1, 2, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(2, 1, 16, 1, 16),
              None, rope=RotaryEmbedding(rope_inv_freq(16, 1e4), 8))


# ---- the models through the runner ------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["llama", "phi3"])
def test_models_fused_match_unfused(monkeypatch, model_name):
    """Every layer fuses (RotaryEmbedding is never called) and the logits match the unfused run."""
    if model_name == "llama":
        model = fg.models.Llama(fg.models.LlamaConfig.toy(), device=DEVICE)
    else:
        from fullgraph.models.phi3_small import Phi3Small, Phi3SmallConfig
        model = Phi3Small(Phi3SmallConfig.toy(), seed=1, device=DEVICE)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (37, 5)]

    def run(fused: bool) -> list[torch.Tensor]:
        runner = fg.FullGraphRunner(model, attention="triton", cudagraph="padded", max_num_seqs=4,
                                    max_num_tokens=64, max_model_len=128, block_size=16)
        blocks = [runner.blocks.allocate(8) for _ in prompts]
        with monkeypatch.context() as m:
            if fused:
                m.setattr(RotaryEmbedding, "fusable", lambda self, x: True)
                m.setattr(RotaryEmbedding, "forward", lambda *a: pytest.fail("a layer did not fuse RoPE"))
            logits = [runner.step([fg.SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)]).logits]
            for i in range(3):
                chunks = [fg.SeqChunk([7 + i], len(p) + i, b) for p, b in zip(prompts, blocks)]
                logits.append(runner.step(chunks).logits)
        return logits

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
