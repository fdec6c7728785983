"""Block-sparse attention: layout, Triton prefill/decode kernels, backend, PyTorch fallback.

CPU: the kernels run under ``TRITON_INTERPRET=1`` on small float32 shapes (block 16, 4 local
blocks, vertical stride 4), so a few hundred tokens exercise the sparsity. The reference below is
built directly from the KEEP rule (not from fullgraph code): per-head block mask expanded to tokens,
AND token causality, a 0/-inf bias, softmax in float64 with the KV heads repeated.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fullgraph.attention import Attention, AttentionMetadata
from fullgraph.attention.backends import BackendLimits
from fullgraph.attention.backends.blocksparse import BlockSparseBackend
from fullgraph.attention.blocksparse import GROUP_BITS, BlockSparseConfig, build_group_layout, build_layout
from fullgraph.kernels import blocksparse_decode as blocksparse_decode_module
from fullgraph.kernels.blocksparse_decode import blocksparse_decode, decode_num_splits
from fullgraph.kernels.blocksparse_prefill import blocksparse_prefill

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
CFG = BlockSparseConfig(block_size=16, local_blocks=4, vert_stride=4, num_heads_total=8, head_offset=2)
HOMO = BlockSparseConfig(block_size=16, local_blocks=4, vert_stride=4, homo_head=True, num_heads_total=8)
WINDOW = CFG.local_blocks * CFG.block_size          # 64 tokens: up to here the pattern is dense
SCALE = 0.25


# ---- the reference ---------------------------------------------------------------------------
def keep_ref(cfg: BlockSparseConfig, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """KEEP(h, i, j) for global heads head_offset.. : (H, Lq, Lk) bool, causality included."""
    h = torch.arange(cfg.head_offset, cfg.head_offset + num_heads, device=q_pos.device)[:, None, None]
    step = 0 if cfg.homo_head else max(1, cfg.vert_stride // cfg.num_heads_total)
    i, j = q_pos[None, :, None], k_pos[None, None, :]
    qb, kb = i // cfg.block_size, j // cfg.block_size
    return (j <= i) & (((qb - kb) < cfg.local_blocks) | ((kb + h * step + 1) % cfg.vert_stride == 0))


def attention_ref(q, k, v, start: int, scale: float, cfg: BlockSparseConfig | None) -> torch.Tensor:
    """q (Lq, H, D) at positions start.., k/v (S, KVH, D) the whole sequence -> (Lq, H, D) float64 (CPU).

    ``cfg=None`` is dense causal attention. Computed on q's device, one head at a time."""
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    dev = q.device
    q_pos, k_pos = torch.arange(start, start + q.shape[0], device=dev), torch.arange(k.shape[0], device=dev)
    if cfg is None:
        mask = (k_pos[None, None, :] <= q_pos[None, :, None]).expand(num_heads, -1, -1)
    else:
        mask = keep_ref(cfg, num_heads, q_pos, k_pos)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].to(dev, torch.float64), v[:, h // group].to(dev, torch.float64)
        s = (q[:, h].double() @ kh.T) * scale                                  # (Lq, S)
        s = s + torch.zeros_like(s).masked_fill(~mask[h], float("-inf"))      # the 0/-inf bias
        out[:, h] = (s.softmax(-1) @ vh).cpu()
    return out


# ---- paged batches with NaN poisoning ------------------------------------------------------------
@dataclass
class Batch:
    q: torch.Tensor            # (T, H, D), padded tail NaN
    k: torch.Tensor            # (T, KVH, D) new keys, padded tail NaN
    v: torch.Tensor
    kv_cache: torch.Tensor     # (2, NB, P, KVH, D); unused pages and the null block NaN
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    seqs: list                 # per real request: (ctx_len, q_len, k_full, v_full)
    layer_scale: float = SCALE

    def metadata(self, decode_only: bool, backend) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                 block_table=self.block_table, slot_mapping=self.slot_mapping,
                                 decode_only=decode_only, backends={"blocksparse": backend})

    def expected(self, scale: float, cfg: BlockSparseConfig | None) -> torch.Tensor:
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        starts = self.query_start_loc.tolist()
        for r, (ctx, q_len, k_full, v_full) in enumerate(self.seqs):
            rows = slice(starts[r], starts[r] + q_len)
            out[rows] = attention_ref(self.q[rows], k_full, v_full, ctx, scale, cfg)
        return out


def make_batch(specs, *, num_heads=4, num_kv_heads=2, head_dim=16, page=16, pad_reqs=1, pad_tokens=3,
               write_new=True, dtype=torch.float32, device=DEV, max_len=512) -> Batch:
    """Requests (ctx_len, q_len); context already in the cache; new tokens written if ``write_new``."""
    gen = torch.Generator().manual_seed(len(specs) * 1000 + sum(c + q for c, q in specs))
    width = -(-max_len // page)
    num_reqs = len(specs) + pad_reqs
    num_pages = len(specs) * width + 2
    cache = torch.full((2, num_pages, page, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()   # never the null block 0
    qs, ks, vs, slots, seqs, starts, lens = [], [], [], [], [], [0], []
    for r, (ctx, q_len) in enumerate(specs):
        n = ctx + q_len
        table[r, : -(-n // page)] = torch.tensor(pages[r * width: r * width + -(-n // page)], dtype=torch.int32)
        k_full, v_full = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        pos = torch.arange(n if write_new else ctx)
        slot = table[r, pos // page].long() * page + pos % page
        cache[0].view(-1, num_kv_heads, head_dim)[slot] = k_full[pos].to(dtype)
        cache[1].view(-1, num_kv_heads, head_dim)[slot] = v_full[pos].to(dtype)
        new = torch.arange(ctx, n)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        ks.append(k_full[ctx:])
        vs.append(v_full[ctx:])
        slots.append(table[r, new // page].long() * page + new % page)
        seqs.append((ctx, q_len, k_full.to(dtype).double(), v_full.to(dtype).double()))
        starts.append(starts[-1] + q_len)
        lens.append(n)
    starts += [starts[-1]] * pad_reqs
    lens += [0] * pad_reqs

    def packed(parts, width):
        nan = torch.full((pad_tokens, width, head_dim), float("nan"))
        return torch.cat(parts + [nan]).to(dtype).to(device)

    i32 = dict(dtype=torch.int32, device=device)
    return Batch(packed(qs, num_heads), packed(ks, num_kv_heads), packed(vs, num_kv_heads), cache.to(device),
                 torch.tensor(starts, **i32), torch.tensor(lens, **i32), table.to(device),
                 torch.cat(slots + [torch.full((pad_tokens,), -1)]).to(device), seqs)


def layout_for(cfg: BlockSparseConfig, batch: Batch, max_len: int = 512):
    return build_layout(cfg, batch.q.shape[1], max_len, batch.q.device)


def run_prefill(batch: Batch, cfg: BlockSparseConfig, scale: float = SCALE) -> torch.Tensor:
    lay = layout_for(cfg, batch)
    return blocksparse_prefill(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                               lay.counts, lay.indices, sm_scale=scale, sparse_block_size=cfg.block_size)


def run_decode(batch: Batch, cfg: BlockSparseConfig, num_splits: int, scale: float = SCALE,
               arrivals: torch.Tensor | None = None) -> torch.Tensor:
    lay = build_group_layout(layout_for(cfg, batch), batch.kv_cache.shape[3])
    rows = batch.q.shape[0] * batch.q.shape[1] * num_splits
    part_out = torch.full((rows, batch.q.shape[2]), float("nan"), device=batch.q.device)
    part_ml = torch.full((rows, 2), float("nan"), device=batch.q.device)
    return blocksparse_decode(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, lay.counts, lay.entries,
                              part_out, part_ml, sm_scale=scale, sparse_block_size=cfg.block_size,
                              num_splits=num_splits, arrivals=arrivals)


def assert_matches(out: torch.Tensor, batch: Batch, cfg: BlockSparseConfig | None, tol: float = 2e-5) -> None:
    assert not torch.isnan(out).any(), "NaN leaked into the output"
    expected = batch.expected(SCALE, cfg)
    err = (out.double().cpu() - expected).abs().max().item()
    assert err <= tol, f"max |out - reference| = {err:.3g} > {tol:g}"


# ---- layout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    CFG, HOMO,
    BlockSparseConfig(block_size=16, local_blocks=3, vert_stride=8, num_heads_total=4, head_offset=1),  # step 2
    BlockSparseConfig(block_size=32, local_blocks=1, vert_stride=5, num_heads_total=2),
], ids=["per-head-offset", "homo", "step2", "local1"])
def test_layout_rows_are_the_keep_rule(cfg):
    num_heads = cfg.num_heads_total - cfg.head_offset
    lay = build_layout(cfg, num_heads, max_model_len=1000)
    pos = torch.arange(lay.num_q_blocks) * cfg.block_size
    keep = keep_ref(cfg, num_heads, pos, pos)                          # block granularity
    for h in range(num_heads):
        for qb in range(lay.num_q_blocks):
            n = int(lay.counts[h, qb])
            assert lay.indices[h, qb, :n].tolist() == torch.nonzero(keep[h, qb]).flatten().tolist(), (h, qb)
            assert (lay.indices[h, qb, n:] == -1).all()
    assert lay.width == int(lay.counts.max())


def test_layout_phi3_128k_sampled():
    cfg = BlockSparseConfig()   # Phi-3-Small: 64 / 16 / 8, 32 heads
    lay = build_layout(cfg, 32, 131072)
    assert lay.counts.shape == (32, 2048) and lay.indices.shape == (32, 2048, lay.width)
    gen = torch.Generator().manual_seed(1)
    for h, qb in zip(torch.randint(0, 32, (40,), generator=gen).tolist(),
                     torch.randint(0, 2048, (40,), generator=gen).tolist()):
        pos = torch.arange(qb + 1) * 64
        keep = keep_ref(cfg, 32, pos[-1:], pos)[h, 0]
        n = int(lay.counts[h, qb])
        assert lay.indices[h, qb, :n].tolist() == torch.nonzero(keep).flatten().tolist(), (h, qb)
    # Density vs dense causal at 128K: 0.14 (PHI3_SMALL.md).
    density = lay.counts.double().sum() / (32 * 2048 * 2049 / 2)
    assert 0.12 < density.item() < 0.16


@pytest.mark.parametrize("cfg,num_heads,num_kv_heads", [
    (CFG, 4, 2), (CFG, 4, 1), (HOMO, 4, 2), (BlockSparseConfig(), 32, 8),
    (BlockSparseConfig(block_size=16, local_blocks=3, vert_stride=8, num_heads_total=8, head_offset=2), 6, 2),
], ids=["g2", "g4", "homo", "phi3", "offset-g3"])
def test_group_layout_is_the_union_of_its_heads(cfg, num_heads, num_kv_heads):
    """Each group row lists, ascending, every key block some head of the group keeps, with a bit
    per head that keeps it; -1 past the count. The entry format is the decode kernel's."""
    assert GROUP_BITS == blocksparse_decode_module.GROUP_BITS
    lay = build_layout(cfg, num_heads, max_model_len=3000)
    glay = build_group_layout(lay, num_kv_heads)
    group = num_heads // num_kv_heads
    for k in range(num_kv_heads):
        for qb in range(lay.num_q_blocks):
            want: dict[int, int] = {}
            for g in range(group):
                for kb in lay.indices[k * group + g, qb, : lay.counts[k * group + g, qb]].tolist():
                    want[kb] = want.get(kb, 0) | 1 << g
            n = int(glay.counts[k, qb])
            row = glay.entries[k, qb, :n].tolist()
            assert [e >> GROUP_BITS for e in row] == sorted(want), (k, qb)
            assert {e >> GROUP_BITS: e & ((1 << GROUP_BITS) - 1) for e in row} == want, (k, qb)
            assert (glay.entries[k, qb, n:] == -1).all()
    assert glay.width == int(glay.counts.max())


def test_group_layout_and_decode_refuse_mismatches():
    lay = build_layout(CFG, 4, max_model_len=256)
    with pytest.raises(ValueError, match="multiple of KVH"):
        build_group_layout(lay, 3)
    with pytest.raises(ValueError, match="at most 16 query heads"):
        build_group_layout(build_layout(BlockSparseConfig(num_heads_total=32), 32, 256), 1)
    batch = make_batch(DECODE, pad_reqs=0, pad_tokens=0)
    per_head = layout_for(CFG, batch)           # the prefill layout: one row per query head
    rows = batch.q.shape[0] * batch.q.shape[1] * 2
    with pytest.raises(ValueError, match="BlockSparseGroupLayout"):
        blocksparse_decode(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, per_head.counts,
                           per_head.indices, torch.empty(rows, 16), torch.empty(rows, 2), sm_scale=SCALE,
                           sparse_block_size=CFG.block_size, num_splits=2)


@pytest.mark.parametrize("heads", [(4, 1), (8, 1), (6, 2)], ids=["g4", "g8", "g3"])
def test_decode_kernel_wider_groups(heads):
    """Groups of 3, 4 and 8 query heads with per-head vertical blocks: rows of one program keep
    different blocks, split and unsplit."""
    cfg = BlockSparseConfig(block_size=16, local_blocks=2, vert_stride=4, num_heads_total=8)
    batch = make_batch(DECODE, num_heads=heads[0], num_kv_heads=heads[1], pad_reqs=2, pad_tokens=2)
    for splits in (1, 3):
        assert_matches(run_decode(batch, cfg, splits), batch, cfg)


# ---- prefill -----------------------------------------------------------------------------------
# Chunks longer than the window, starting mid-block after cached context, 1-token chunks, a
# chunk ending on a page boundary, and padded zero-length requests / tokens.
MIXED = [(0, 150), (37, 120), (100, 1), (5, 11), (200, 40)]


@pytest.mark.parametrize("cfg", [CFG, HOMO], ids=["per-head-offset", "homo"])
def test_prefill_kernel_matches_reference(cfg):
    batch = make_batch(MIXED, pad_reqs=2, pad_tokens=5)
    out = run_prefill(batch, cfg)
    assert_matches(out, batch, cfg)
    assert (out[-5:] == 0).all(), "padded token rows must be zeros"


def test_prefill_gqa_wider_head_dim_step2():
    cfg = BlockSparseConfig(block_size=16, local_blocks=3, vert_stride=8, num_heads_total=4)
    batch = make_batch([(70, 90), (0, 33)], num_heads=4, num_kv_heads=1, head_dim=32)
    assert_matches(run_prefill(batch, cfg), batch, cfg)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_backend_mixed_step_writes_kv_and_matches(impl):
    batch = make_batch(MIXED, write_new=False, pad_reqs=2, pad_tokens=4)
    backend, layer = make_backend(CFG, impl, batch)
    out = layer(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata(False, backend)).view(batch.q.shape)
    assert_matches(out, batch, CFG)
    assert (out[-4:] == 0).all()


def test_dense_at_window_and_sparse_beyond():
    """<= local_blocks * block_size tokens is dense causal; beyond it, it is not (no dense fallback)."""
    short = make_batch([(0, WINDOW), (WINDOW - 20, 20)], pad_reqs=0, pad_tokens=0)
    assert_matches(run_prefill(short, CFG), short, None)
    long = make_batch([(0, 4 * WINDOW)], pad_reqs=0, pad_tokens=0)
    out = run_prefill(long, CFG)
    assert_matches(out, long, CFG)
    assert (out.double().cpu() - long.expected(SCALE, None)).abs()[2 * WINDOW:].max() > 1e-2


# ---- decode ------------------------------------------------------------------------------------
# Last positions around the window edge (63, 64, 65), on vertical blocks and between them, a
# 1-token sequence, and a page boundary (seq_len 160).
DECODE = [(62, 1), (63, 1), (64, 1), (0, 1), (160, 1), (250, 1), (301, 1), (127, 1)]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_kernel_matches_reference(num_splits):
    batch = make_batch(DECODE, pad_reqs=2, pad_tokens=2)
    out = run_decode(batch, CFG, num_splits)
    assert_matches(out, batch, CFG)
    assert (out[-2:] == 0).all(), "padded requests must be zeros"


@pytest.mark.parametrize("num_splits", [3, 8, 17])
def test_decode_splits_merged_in_the_launch(num_splits):
    """The last split to arrive merges (``arrivals``): the rows of the two-launch form, the
    counters back at zero after each launch, so the next launch merges too."""
    batch = make_batch(DECODE, pad_reqs=2, pad_tokens=2)
    two = run_decode(batch, CFG, num_splits)
    arrivals = torch.zeros(batch.q.shape[0] * batch.kv_cache.shape[3], dtype=torch.int32, device=DEV)
    for _ in range(2):
        out = run_decode(batch, CFG, num_splits, arrivals=arrivals)
        assert_matches(out, batch, CFG)
        assert (out[-2:] == 0).all(), "padded requests must be zeros"
        assert not arrivals.any(), "every counter is reset by the split that merged"
        torch.testing.assert_close(out, two, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="arrivals"):
        run_decode(batch, CFG, num_splits, arrivals=arrivals[:1])


@pytest.mark.skipif(DEV.type == "cuda", reason="needs the interpreter's one-program-at-a-time order")
def test_decode_merge_counts_each_request_and_kv_head_apart():
    """A counter already at 1 for one (request, KV head) makes that pair merge one split early:
    only that pair's rows go wrong and only its counter is left over."""
    batch = make_batch([(250, 1), (301, 1), (160, 1)], pad_reqs=0, pad_tokens=0)
    kvh, group = batch.kv_cache.shape[3], batch.q.shape[1] // batch.kv_cache.shape[3]
    two = run_decode(batch, CFG, 3)
    arrivals = torch.zeros(3 * kvh, dtype=torch.int32, device=DEV)
    arrivals[1 * kvh + kvh - 1] = 1                          # request 1, the last KV head
    out = run_decode(batch, CFG, 3, arrivals=arrivals)
    wrong = ~torch.isclose(out, two, atol=1e-5, rtol=1e-5).all(-1)                 # (R, H)
    expected = torch.zeros_like(wrong)
    expected[1, (kvh - 1) * group:] = True
    assert torch.equal(wrong, expected)
    left = torch.zeros_like(arrivals)
    left[1 * kvh + kvh - 1] = 1
    assert torch.equal(arrivals, left)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_backend_decode_step(impl):
    batch = make_batch(DECODE, write_new=False, pad_reqs=2, pad_tokens=2)
    backend, layer = make_backend(HOMO, impl, batch, max_num_seqs=16)
    out = layer(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata(True, backend)).view(batch.q.shape)
    assert_matches(out, batch, HOMO)
    assert (out[-2:] == 0).all()


def test_prefill_and_decode_agree():
    """The last token of a prefill and the same token decoded use the same row of the pattern."""
    lens = [WINDOW + 1, 3 * WINDOW + 17, 2 * WINDOW]
    prefill = make_batch([(0, n) for n in lens], pad_reqs=0, pad_tokens=0)
    out_p = run_prefill(prefill, CFG)
    last = prefill.query_start_loc[1:].long() - 1
    decode = Batch(prefill.q[last].contiguous(), prefill.k[last], prefill.v[last], prefill.kv_cache,
                   torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV), prefill.seq_lens,
                   prefill.block_table, prefill.slot_mapping[last], [])
    out_d = run_decode(decode, CFG, num_splits=2)
    assert (out_d - out_p[last]).abs().max().item() < 1e-5


# ---- page size / sparse block nesting ----------------------------------------------------------
@pytest.mark.parametrize("page,block", [(16, 64), (64, 16)])
def test_page_and_sparse_block_nest_both_ways(page, block):
    cfg = BlockSparseConfig(block_size=block, local_blocks=2, vert_stride=2, num_heads_total=2)
    batch = make_batch([(50, 230), (180, 1)], num_heads=2, num_kv_heads=1, page=page, pad_reqs=1, pad_tokens=1)
    assert_matches(run_prefill(batch, cfg), batch, cfg)
    dec = make_batch([(300, 1), (129, 1)], num_heads=2, num_kv_heads=1, page=page, pad_reqs=1, pad_tokens=1)
    assert_matches(run_decode(dec, cfg, num_splits=2), dec, cfg)


def test_non_nesting_page_size_is_a_clear_error():
    layer = Attention(4, 2, 16, SCALE, kind="blocksparse", sparse=CFG)
    limits = BackendLimits(4, 64, 256, 24, 32, DEV, torch.float32)
    with pytest.raises(ValueError, match="must nest"):
        BlockSparseBackend(limits, [layer])
    batch = make_batch([(0, 20)], page=16)
    odd = batch.kv_cache[:, :, :12].contiguous()       # a 12-token page cannot nest with 16
    lay = layout_for(CFG, batch)
    with pytest.raises(ValueError, match="must nest"):
        blocksparse_prefill(batch.q, odd, batch.query_start_loc, batch.seq_lens, batch.block_table,
                            lay.counts, lay.indices, sm_scale=SCALE, sparse_block_size=16)


# ---- backend wiring ----------------------------------------------------------------------------
def make_backend(cfg: BlockSparseConfig, impl: str, batch: Batch, max_num_seqs: int = 8):
    num_heads, head_dim = batch.q.shape[1:]
    layer = Attention(num_heads, batch.kv_cache.shape[3], head_dim, SCALE, kind="blocksparse", sparse=cfg)
    limits = BackendLimits(max_num_seqs, 512, 512, batch.kv_cache.shape[2], batch.kv_cache.shape[1],
                           batch.q.device, batch.q.dtype)
    return BlockSparseBackend(limits, [layer], impl=impl), layer


def test_backend_picks_triton_under_the_interpreter_or_cuda():
    batch = make_batch([(0, 4)])
    backend, _ = make_backend(CFG, "auto", batch)
    assert backend.impl == "triton"
    layer = Attention(4, 2, 24, SCALE, kind="blocksparse", sparse=CFG)       # head_dim 24: no kernel
    limits = BackendLimits(4, 64, 256, 16, 32, DEV, torch.float32)
    assert BlockSparseBackend(limits, [layer]).impl == "torch"
    with pytest.raises(ValueError, match="head_dim 24"):
        BlockSparseBackend(limits, [layer], impl="triton")


def test_decode_splits_are_static_and_workspace_fits():
    assert decode_num_splits(1, 8, 1032, 64) == 32 and decode_num_splits(16, 8, 1032, 64) == 8
    assert decode_num_splits(256, 8, 1032, 64) == 1 and decode_num_splits(1, 8, 2, 64) == 1
    assert decode_num_splits(1, 8, 20, 64) == 10  # short rows at batch 1: about two sparse blocks per split
    batch = make_batch(DECODE)
    backend, layer = make_backend(CFG, "triton", batch, max_num_seqs=12)
    lay = backend.group_layout(layer)
    need = max(r * 4 * decode_num_splits(r, lay.num_kv_heads, lay.width, 16) for r in range(1, 13))
    assert backend._partial_out.shape[0] >= need


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_compile_fullgraph_traces_the_kernels(decode_only):
    specs = [(20, 1), (0, 1)] if decode_only else [(20, 30), (0, 1)]
    batch = make_batch(specs, pad_reqs=1, pad_tokens=1, write_new=False)
    backend, layer = make_backend(CFG, "triton", batch)

    def step(q, k, v, cache, qsl, seq_lens, table, slots):
        md = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                               decode_only=decode_only, backends={"blocksparse": backend})
        return layer(q, k, v, cache, md).view(q.shape)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(batch.q, batch.k, batch.v, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                   batch.block_table, batch.slot_mapping)
    assert_matches(out, batch, CFG)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) kernels and mutation declarations of the registered ops."""
    batch = make_batch([(10, 5), (0, 1)], pad_reqs=1, pad_tokens=1)
    cache, lay = torch.nan_to_num(batch.kv_cache), layout_for(CFG, batch)
    torch.library.opcheck(torch.ops.fullgraph.blocksparse_prefill.default,
                          (batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                           lay.counts, lay.indices, SCALE, 16))
    q = torch.randn(3, 4, 16, device=DEV)
    glay = build_group_layout(lay, cache.shape[3])
    part_out, part_ml = torch.zeros(3 * 4 * 2, 16, device=DEV), torch.zeros(3 * 4 * 2, 2, device=DEV)
    seq_lens = torch.tensor([15, 1, 0], dtype=torch.int32, device=DEV)
    torch.library.opcheck(torch.ops.fullgraph.blocksparse_decode.default,
                          (q, cache, seq_lens, batch.block_table, glay.counts, glay.entries, part_out, part_ml,
                           torch.zeros(0, dtype=torch.int32, device=DEV), SCALE, 16, 2))
    torch.library.opcheck(torch.ops.fullgraph.blocksparse_decode.default,
                          (q, cache, seq_lens, batch.block_table, glay.counts, glay.entries, part_out, part_ml,
                           torch.zeros(3 * cache.shape[3], dtype=torch.int32, device=DEV), SCALE, 16, 2))


# ---- GPU: bf16 at Phi-3-Small shapes, CUDA-graph capture --------------------------------------
PHI3 = BlockSparseConfig()   # 64 / 16 / 8, 32 heads, per-head pattern


def _bf16_tolerance(batch: Batch, out: torch.Tensor, cfg: BlockSparseConfig) -> None:
    """Flash-attention rule: kernel error <= 2x PyTorch's own bf16 error + a small floor."""
    ref = batch.expected(batch.layer_scale, cfg)
    starts = batch.query_start_loc.tolist()
    torch_err = 0.0
    for r, (ctx, q_len, k_full, v_full) in enumerate(batch.seqs):
        rows = slice(starts[r], starts[r] + q_len)
        q_pos, k_pos = torch.arange(ctx, ctx + q_len), torch.arange(k_full.shape[0])
        mask = keep_ref(cfg, 32, q_pos, k_pos).to(DEV)
        qq = batch.q[rows].transpose(0, 1)[None]
        kk = k_full.to(DEV, torch.bfloat16).repeat_interleave(4, 1).transpose(0, 1)[None]
        vv = v_full.to(DEV, torch.bfloat16).repeat_interleave(4, 1).transpose(0, 1)[None]
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None], scale=batch.layer_scale)
        torch_err = max(torch_err, (o[0].transpose(0, 1).double().cpu() - ref[rows]).abs().max().item())
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-3, f"bf16 kernel error {err:.3g} > 2 x torch's {torch_err:.3g} + 1e-3"


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[(0, 2048)], [(1000, 3000), (0, 1)], [(4100, 4092)]])
def test_gpu_bf16_phi3_prefill(lens):
    batch = make_batch(lens, num_heads=32, num_kv_heads=8, head_dim=128, page=16, dtype=torch.bfloat16,
                       max_len=8192, pad_reqs=1, pad_tokens=3)
    batch.layer_scale = 1 / 128
    lay = build_layout(PHI3, 32, 8192, DEV)
    out = blocksparse_prefill(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                              lay.counts, lay.indices, sm_scale=1 / 128, sparse_block_size=64)
    assert not torch.isnan(out).any()
    _bf16_tolerance(batch, out, PHI3)


@pytest.mark.gpu
def test_gpu_bf16_phi3_decode():
    batch = make_batch([(n - 1, 1) for n in (1024, 1025, 1600, 4097, 8000)], num_heads=32, num_kv_heads=8,
                       head_dim=128, page=64, dtype=torch.bfloat16, max_len=8192, pad_reqs=3, pad_tokens=3)
    batch.layer_scale = 1 / 128
    lay = build_group_layout(build_layout(PHI3, 32, 8192, DEV), 8)
    splits = decode_num_splits(batch.q.shape[0], 8, lay.width, 64)
    rows = batch.q.shape[0] * 32 * splits
    out = blocksparse_decode(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, lay.counts, lay.entries,
                             torch.empty(rows, 128, device=DEV), torch.empty(rows, 2, device=DEV),
                             sm_scale=1 / 128, sparse_block_size=64, num_splits=splits)
    assert not torch.isnan(out).any() and (out[-3:] == 0).all()
    _bf16_tolerance(batch, out, PHI3)
    arrivals = torch.zeros(batch.q.shape[0] * 8, dtype=torch.int32, device=DEV)
    for _ in range(3):                    # merged in the launch: the same rows, the counters reset
        merged = blocksparse_decode(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, lay.counts,
                                    lay.entries, torch.empty(rows, 128, device=DEV), torch.empty(rows, 2, device=DEV),
                                    sm_scale=1 / 128, sparse_block_size=64, num_splits=splits, arrivals=arrivals)
        assert not arrivals.any() and (merged[-3:] == 0).all()
        _bf16_tolerance(batch, merged, PHI3)
        torch.testing.assert_close(merged.float(), out.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_only", [False, True])
def test_gpu_cuda_graph_capture_and_replay(decode_only):
    """Capture once at small lengths, replay with other batches and lengths (static buffers)."""
    max_len, num_reqs, num_tokens = 4096, 4, 512 if not decode_only else 4
    spec = (lambda n: [(n - 1, 1)] * 3) if decode_only else (lambda n: [(n - 300, 300), (n // 2, 100), (0, 7)])
    batches = [make_batch(spec(n), num_heads=32, num_kv_heads=8, head_dim=128, page=64, dtype=torch.bfloat16,
                          max_len=max_len, pad_reqs=num_reqs - 3, pad_tokens=0) for n in (320, 1500, 4000)]
    template = batches[0]
    static = {name: getattr(template, name).clone() for name in
              ("query_start_loc", "seq_lens", "block_table", "slot_mapping")}
    static["q"] = torch.zeros(num_tokens, 32, 128, dtype=torch.bfloat16, device=DEV)
    static["k"] = torch.zeros(num_tokens, 8, 128, dtype=torch.bfloat16, device=DEV)
    static["v"] = torch.zeros_like(static["k"])
    static["slot_mapping"] = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEV)
    cache = torch.zeros_like(template.kv_cache)
    layer = Attention(32, 8, 128, 1 / 128, kind="blocksparse", sparse=PHI3)
    backend = BlockSparseBackend(BackendLimits(num_reqs, num_tokens, max_len, 64, cache.shape[1], DEV,
                                               torch.bfloat16), [layer])

    def load(batch: Batch) -> None:
        n = batch.q.shape[0]
        cache.copy_(batch.kv_cache)
        for name in ("q", "k", "v", "slot_mapping"):
            static[name][:n].copy_(getattr(batch, name))
            static[name][n:] = -1 if name == "slot_mapping" else 0
        for name in ("query_start_loc", "seq_lens", "block_table"):
            static[name].copy_(getattr(batch, name))

    def run():
        md = AttentionMetadata(query_start_loc=static["query_start_loc"], seq_lens=static["seq_lens"],
                               block_table=static["block_table"], slot_mapping=static["slot_mapping"],
                               decode_only=decode_only, backends={"blocksparse": backend})
        return layer(static["q"], static["k"], static["v"], cache, md).view(static["q"].shape)

    load(template)
    run()                                                        # warm-up (JIT) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for batch in batches[::-1]:
        batch.layer_scale = 1 / 128
        load(batch)
        graph.replay()
        torch.cuda.synchronize()
        got = out[: batch.q.shape[0]]
        assert not torch.isnan(got).any()
        _bf16_tolerance(batch, got, PHI3)
