"""Padded rows are inert: kernels given NaN in every padded input row give the same real rows as
with finite padding, padded output rows are zeros (defined, never stale memory), and the cache is
untouched by padding. The CPU guard of what compute-sanitizer's initcheck checks on the GPU: a
kernel that read a padded row would carry its NaN somewhere these tests look."""
from __future__ import annotations

import torch

import fullgraph as fg
from fullgraph.attention import Attention, AttentionMetadata, BackendLimits
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.kernels import kv_write, paged_attention, rope_kv_write

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")
PAGE, KVH, H, D = 16, 2, 4, 32


def _step(pad_value: float, seed: int = 0):
    """Two real requests (a 5-token prompt, a decode at 20) and 3 padded tokens / 2 padded requests."""
    gen = torch.Generator().manual_seed(seed)
    real, pad = 6, 3
    q = torch.randn(real + pad, H, D, generator=gen)
    k, v = torch.randn(real + pad, KVH, D, generator=gen), torch.randn(real + pad, KVH, D, generator=gen)
    for t in (q, k, v):
        t[real:] = pad_value
    cache = torch.randn(2, 8, PAGE, KVH, D, generator=gen)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    meta = dict(
        query_start_loc=torch.tensor([0, 5, 6, 6, 6], **i32), seq_lens=torch.tensor([5, 21, 0, 0], **i32),
        block_table=torch.tensor([[1, 0], [2, 3], [0, 0], [0, 0]], **i32),
        slot_mapping=torch.tensor([16, 17, 18, 19, 20, 2 * 16 + 16 + 4, -1, -1, -1], dtype=torch.int64, device=DEVICE),
        positions=torch.tensor([0, 1, 2, 3, 4, 20, 0, 0, 0], device=DEVICE))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), meta


def _tables(max_pos: int = 64):
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), torch.rand(D // 2, dtype=torch.float64))
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def test_rope_kv_write_never_reads_a_padded_row_and_zeroes_its_q():
    cos, sin = _tables()
    outs = []
    for pad in (7.0, NAN):
        q, k, v, cache, m = _step(pad)
        q_out = rope_kv_write(query=q, key=k, value=v, kv_cache=cache, slot_mapping=m["slot_mapping"],
                              positions=m["positions"], cos=cos, sin=sin)
        outs.append((q_out, cache))
    (q_a, cache_a), (q_b, cache_b) = outs
    assert torch.equal(q_a[:6], q_b[:6]) and torch.equal(cache_a, cache_b)
    assert not q_b[6:].any() and not q_a[6:].any()        # padded rows: zeros, whatever the padding held


def test_kv_write_leaves_the_cache_untouched_by_padding():
    q, k, v, cache, m = _step(NAN)
    before = cache.clone()
    kv_write(key=k, value=v, kv_cache=cache, slot_mapping=m["slot_mapping"])
    assert not torch.isnan(cache).any()
    changed = (cache != before).any(-1).any(-1).view(2, -1).any(0)          # (slots,)
    assert set(changed.nonzero().flatten().tolist()) <= set(m["slot_mapping"][:6].tolist())


def test_paged_attention_real_rows_ignore_padded_queries_and_padded_rows_are_zero():
    outs = []
    for pad in (7.0, NAN):
        q, k, v, cache, m = _step(pad)
        kv_write(key=k, value=v, kv_cache=cache, slot_mapping=m["slot_mapping"])
        outs.append(paged_attention(q, cache, m["query_start_loc"], m["seq_lens"], m["block_table"], scale=D ** -0.5,
                                    decode_only=False))
    assert torch.equal(outs[0][:6], outs[1][:6]) and not outs[1][6:].any() and not torch.isnan(outs[1]).any()


def test_reference_decode_gives_zeros_for_padded_requests():
    limits = BackendLimits(4, 16, 64, PAGE, 8, DEVICE, torch.float32)
    layer = Attention(H, KVH, D, D ** -0.5)
    backend = SdpaBackend(limits, [layer])
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, H, D, generator=gen), torch.randn(4, KVH, D, generator=gen), torch.randn(4, KVH, D, generator=gen)
    q[2:], k[2:], v[2:] = NAN, NAN, NAN
    cache = torch.randn(2, 8, PAGE, KVH, D, generator=gen)
    i32 = dict(dtype=torch.int32)
    md = AttentionMetadata(query_start_loc=torch.arange(5, **i32).clamp(max=2), seq_lens=torch.tensor([7, 20, 0, 0], **i32),
                           block_table=torch.tensor([[1, 0], [2, 3], [0, 0], [0, 0]], **i32),
                           slot_mapping=torch.tensor([16 + 6, 32 + 16 + 3, -1, -1]), decode_only=True,
                           backends={"dense": backend})
    out = layer(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), md).view(4, H, D)
    assert torch.isfinite(out[:2]).all() and not out[2:].any()


def test_a_poisoned_step_through_every_cpu_backend_keeps_real_logits(registered_backend):
    """The whole model in validate mode (tails, outputs and workspaces poisoned) on each backend."""
    model = fg.models.Llama(fg.models.LlamaConfig.toy())
    for attention in ("sdpa", "triton"):
        runner = fg.FullGraphRunner(model, attention=attention, cudagraph="padded", validate=True, max_num_seqs=4,
                                    max_num_tokens=32, max_model_len=64)
        ref = fg.FullGraphRunner(model, attention=attention, cudagraph="none", max_num_seqs=4, max_num_tokens=32,
                                 max_model_len=64)
        pages = [runner.blocks.allocate(2) for _ in range(3)]
        assert [ref.blocks.allocate(2) for _ in range(3)] == pages
        for chunks in ([fg.SeqChunk([1, 2, 3], 0, pages[0]), fg.SeqChunk([4] * 9, 0, pages[1])],
                       [fg.SeqChunk([5], 3, pages[0]), fg.SeqChunk([6], 9, pages[1]), fg.SeqChunk([7, 8], 0, pages[2])]):
            torch.testing.assert_close(runner.step(chunks).logits, ref.step(chunks).logits, atol=1e-5, rtol=1e-5)
