"""Triton kernels (paged attention, split-KV reduce, KV write) and the ``triton`` backend.

CPU: the kernels run under ``TRITON_INTERPRET=1`` in float32 on small shapes. GPU (``-m gpu``):
bf16 against an fp64 reference with the FlashAttention rule, split-KV on/off, CUDA-graph replay.
The reference is written here (float64, per request: gather pages, positions, causal mask, GQA).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

import fullgraph
from fullgraph.attention import Attention
from fullgraph.attention.backends import BackendLimits, get_backend_class
from fullgraph.attention import AttentionMetadata
from fullgraph.kernels import KernelConfig, kv_write, num_kv_splits, paged_attention, split_workspace_rows
from fullgraph.kernels.split_kv_reduce import MAX_SPLITS, merge_chunk
from fullgraph.kernels.attention_config import LONG_PROGRAM_KEYS, default_config
from fullgraph.attention.backends import triton as triton_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass
class Batch:
    """One step: q/k/v of every (padded) token and a cache holding every real position."""

    q: torch.Tensor                # (T, H, D); padding rows NaN
    k: torch.Tensor                # (T, KVH, D): the new tokens' keys (as in the cache); padding NaN
    v: torch.Tensor
    kv_cache: torch.Tensor         # (2, NB, page, KVH, D): real positions random, everything else NaN
    query_start_loc: torch.Tensor  # (R + 1,) int32, tail repeats the last real value
    seq_lens: torch.Tensor         # (R,) int32, padded requests 0
    block_table: torch.Tensor      # (R, MB) int32, null block 0 where unused
    slot_mapping: torch.Tensor     # (T,) int64, padding -1
    num_tokens: int                # real tokens
    decode: bool

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(reqs, *, heads=(4, 2), head_dim=64, page=16, pad_tokens=0, pad_reqs=0, decode=False,
               dtype=torch.float32, seed=0, device=DEVICE) -> Batch:
    """``reqs``: (context_len, query_len) per request. Pages are shuffled; the null block, unused
    pages, slots past each seq_len and padded q/k/v rows hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    pages_of = [-(-(c + n) // page) for c, n in reqs]
    num_blocks = sum(pages_of) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv = torch.full((2, num_blocks, page, num_kv_heads, head_dim), NAN)
    table = torch.zeros(len(reqs) + pad_reqs, max(pages_of) + 1, dtype=torch.int32)
    qsl, seq_lens, slots = [0], [], []
    for r, ((ctx, n), npages) in enumerate(zip(reqs, pages_of)):
        ids = [order.pop() for _ in range(npages)]
        table[r, :npages] = torch.tensor(ids, dtype=torch.int32)
        flat = torch.tensor([ids[p // page] * page + p % page for p in range(ctx + n)])
        kv.view(2, -1, num_kv_heads, head_dim)[:, flat] = torch.randn(2, ctx + n, num_kv_heads, head_dim, generator=gen)
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
        slots += flat[ctx:].tolist()
    num_tokens = qsl[-1]
    total = num_tokens + pad_tokens
    if decode:
        assert all(n == 1 for _, n in reqs) and pad_tokens == pad_reqs
    slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    q[num_tokens:] = NAN
    flat_kv = kv.view(2, -1, num_kv_heads, head_dim)
    new = torch.full((2, total, num_kv_heads, head_dim), NAN)
    new[:, :num_tokens] = flat_kv[:, slot_mapping[:num_tokens]]
    cast = dict(dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return Batch(q.to(**cast), new[0].to(**cast), new[1].to(**cast), kv.to(**cast),
                 torch.tensor(qsl + [num_tokens] * pad_reqs, **i32), torch.tensor(seq_lens + [0] * pad_reqs, **i32),
                 table.to(device), slot_mapping.to(device), num_tokens, decode)


def reference(b: Batch, dtype=torch.float64) -> torch.Tensor:
    """Plain-PyTorch attention of each real request in ``dtype`` (float64: the ground truth)."""
    num_tokens, num_heads, head_dim = b.q.shape
    page, num_kv_heads = b.kv_cache.shape[2], b.kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=dtype, device=b.q.device)
    qsl, seq_lens, table = b.query_start_loc.tolist(), b.seq_lens.tolist(), b.block_table.tolist()
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        if end <= start:
            continue
        pages = table[r][: -(-seq_len // page)]
        kv = b.kv_cache[:, pages].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len].to(dtype)
        k, v = kv.repeat_interleave(group, dim=2)                        # (L, H, D) each
        scores = torch.einsum("qhd,khd->hqk", b.q[start:end].to(dtype), k) * b.scale
        q_pos = seq_len - (end - start) + torch.arange(end - start, device=out.device)
        keep = torch.arange(seq_len, device=out.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1).to(dtype)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@contextlib.contextmanager
def poisoned_allocations():
    """``torch.empty`` inside fills floats with NaN: an output row the kernel skips shows up."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def run(b: Batch, **kwargs) -> torch.Tensor:
    with poisoned_allocations():
        return paged_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table,
                               scale=b.scale, decode_only=b.decode, **kwargs)


def workspaces(b: Batch, splits: int):
    rows = b.block_table.shape[0] * splits * b.q.shape[1]
    pad = 1 << (b.q.shape[-1] - 1).bit_length()
    return (torch.full((rows * pad,), NAN, device=b.q.device), torch.full((rows,), NAN, device=b.q.device))


def check(out: torch.Tensor, b: Batch, atol: float = 2e-5) -> None:
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert not out.isnan().any(), "an output row was not written, or NaN leaked from the cache"
    torch.testing.assert_close(out[: b.num_tokens].double(), reference(b)[: b.num_tokens], atol=atol, rtol=1e-5)
    assert (out[b.num_tokens:] == 0).all(), "padded token rows must be zeros"


# ---- paged attention, CPU (interpreter) and GPU in float32 ------------------------------------
@pytest.mark.parametrize("reqs, heads, head_dim", [
    ([(0, 97)], (4, 2), 64),
    ([(0, 1), (0, 15), (0, 17), (0, 97)], (4, 2), 64),
    ([(0, 17), (0, 33)], (2, 1), 80),
    ([(0, 20), (0, 1)], (2, 2), 96),
], ids=["97", "unaligned", "hd80", "hd96-mha"])
def test_prefill(reqs, heads, head_dim):
    b = make_batch(reqs, heads=heads, head_dim=head_dim)
    check(run(b), b)


@pytest.mark.parametrize("page", [16, 32])
def test_chunked_prefill_with_context_crosses_pages(page):
    b = make_batch([(13, 20), (32, 17), (5, 40), (16, 16), (47, 1)], page=page, seed=1)
    check(run(b), b)


def test_decode_with_padded_requests():
    b = make_batch([(c, 1) for c in (0, 15, 16, 17, 63, 96)], heads=(8, 2), pad_tokens=2, pad_reqs=2,
                   decode=True, seed=2)
    check(run(b), b)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (8, 1), (4, 4)], ids=["g2", "g3", "g8", "mha"])
def test_mixed_batch_padded(heads):
    """Decode tokens, a fresh prefill and a chunk with context in one launch; padded T and R."""
    b = make_batch([(20, 1), (0, 23), (33, 9), (1, 1)], heads=heads, pad_tokens=13, pad_reqs=3, seed=3)
    check(run(b), b)


def test_config_blocks_smaller_than_a_page():
    b = make_batch([(40, 9), (70, 1)], page=32, pad_tokens=3, pad_reqs=1, seed=4)
    check(run(b, config=KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)), b)


@pytest.mark.parametrize("splits", [2, 3, 5, 16])
def test_split_kv_matches_unsplit(splits):
    """Empty splits (seq_len 1 over 16 splits) and padded requests merge to the same rows."""
    b = make_batch([(c, 1) for c in (0, 16, 40, 95)], heads=(4, 2), pad_tokens=2, pad_reqs=2, decode=True, seed=5)
    part_out, part_lse = workspaces(b, splits)
    split = run(b, num_splits=splits, part_out=part_out, part_lse=part_lse)
    check(split, b)
    torch.testing.assert_close(split, run(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize("splits", [2, 5, 16])
def test_split_kv_merged_in_the_launch(splits, warps):
    """The last split to arrive merges (``arrivals``): the same rows as the two-launch form, the
    counters back at zero after every launch, so the next launch (a replay, the next layer) merges
    too. With 4 warps the merge loads its splits 4 at a time (``merge_chunk``; 5 splits: a chunk
    half past the last split); with 1 warp one at a time, in split_kv_reduce's order."""
    b = make_batch([(c, 1) for c in (0, 16, 40, 95)], heads=(4, 2), pad_tokens=2, pad_reqs=2, decode=True, seed=5)
    part_out, part_lse = workspaces(b, splits)
    config = KernelConfig(16, 32, warps, 1)
    two = run(b, num_splits=splits, part_out=part_out, part_lse=part_lse, config=config)
    arrivals = torch.zeros(b.block_table.shape[0] * 2 + 3, dtype=torch.int32, device=DEVICE)
    chunk = merge_chunk(splits, 16, 64, warps)
    assert chunk == (1 if warps == 1 else min(4, 1 << (splits - 1).bit_length()))
    for _ in range(2):
        part_out.fill_(NAN), part_lse.fill_(NAN)
        merged = run(b, num_splits=splits, part_out=part_out, part_lse=part_lse, arrivals=arrivals, config=config)
        check(merged, b)
        assert not arrivals.any(), "every counter is reset by the split that merged"
        if DEVICE.type == "cpu" and chunk == 1 and splits <= 8:
            assert torch.equal(merged, two), "the same operations in the same order as split_kv_reduce"
        else:   # the weighted sums in another order
            torch.testing.assert_close(merged, two, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="arrivals"):
        run(b, num_splits=splits, part_out=part_out, part_lse=part_lse, arrivals=arrivals[:3])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="needs the interpreter's one-program-at-a-time order")
def test_split_kv_merge_counts_each_request_and_kv_head_apart():
    """A counter already at 1 for one (request, KV head) makes that pair merge one split early:
    only that pair's rows go wrong and only its counter is left over, so every pair has its own."""
    b = make_batch([(c, 1) for c in (40, 95, 70)], heads=(4, 2), decode=True, seed=9)
    part_out, part_lse = workspaces(b, 3)
    two = run(b, num_splits=3, part_out=part_out, part_lse=part_lse)
    arrivals = torch.zeros(3 * 2, dtype=torch.int32, device=DEVICE)
    arrivals[1 * 2 + 1] = 1                                  # request 1, KV head 1 (query heads 2, 3)
    part_out.fill_(NAN), part_lse.fill_(NAN)
    out = run(b, num_splits=3, part_out=part_out, part_lse=part_lse, arrivals=arrivals)
    wrong = ~torch.isclose(out, two, atol=1e-5, rtol=1e-5).all(-1)                 # (T, H)
    expected = torch.zeros_like(wrong)
    expected[1, 2:] = True
    assert torch.equal(wrong, expected)
    assert arrivals.tolist() == [0, 0, 0, 1, 0, 0]


def test_split_count_is_static_and_fits_workspace():
    sms, kv_heads, max_len = 8, 2, 4096
    counts = [num_kv_splits(r, kv_heads, max_len, sms) for r in range(1, 33)]
    assert counts[0] > 1 and counts[-1] == 1, "split at batch 1, not once the SMs are full"
    assert counts == sorted(counts, reverse=True) and max(counts) <= MAX_SPLITS
    assert [c == 1 for c in counts] == [r * kv_heads >= sms for r in range(1, 33)], \
        "unsplit exactly once one program per (request, KV head) fills every SM"
    assert num_kv_splits(1, kv_heads, 64, sms) == 1, "never split below MIN_SPLIT_TOKENS at max_model_len"
    rows = split_workspace_rows(32, kv_heads, max_len, sms)
    assert all(r * c <= rows for r, c in zip(range(1, 33), counts))


@pytest.mark.slow
def test_long_sequences():
    b = make_batch([(0, 1025), (1000, 25)], heads=(2, 1), seed=6)
    check(run(b), b, atol=5e-5)
    d = make_batch([(1024, 1), (512, 1)], heads=(2, 1), decode=True, seed=7)
    part_out, part_lse = workspaces(d, 4)
    check(run(d, num_splits=4, part_out=part_out, part_lse=part_lse), d, atol=5e-5)


def test_query_start_loc_padded_with_minus_one_breaks_the_kernel():
    """The on-device binary search needs a non-decreasing query_start_loc: the registered triton
    policy's tail gives the right rows; a tail of -1 (same plan otherwise) sends the later tiles of
    a long request to a padded request, so those rows are never computed."""
    cfg = fullgraph.RunnerConfig(max_num_seqs=8, max_num_tokens=128, max_model_len=128, block_size=16,
                                 capture_sizes=(96,))
    chunks = [fullgraph.SeqChunk([1] * 80, 0, [1, 2, 3, 4, 5]), fullgraph.SeqChunk([1], 20, [6, 7])]
    good_policy = fullgraph.padding.get_policy("triton")
    bad_policy = fullgraph.PaddingPolicy(name="minus-one", reads=good_policy.reads, tails={"query_start_loc": -1})
    good_plan, bad_plan = (fullgraph.plan_step(chunks, cfg, p, num_blocks=8) for p in (good_policy, bad_policy))
    assert list(bad_plan.query_start_loc[3:]) == [-1] * 6
    b = make_batch([(0, 80), (20, 1)], pad_tokens=96 - 81, pad_reqs=8 - 2, seed=8)
    assert b.query_start_loc.tolist() == good_plan.query_start_loc.tolist()
    check(run(b), b)
    bad = run(dataclasses.replace(b, query_start_loc=torch.from_numpy(bad_plan.query_start_loc).to(DEVICE)))
    err = (bad[: b.num_tokens].double() - reference(b)[: b.num_tokens]).nan_to_num(1.0).abs().amax(dim=(1, 2))
    assert (err > 1e-2).any(), "a -1 tail should leave rows of the long request uncomputed"


# ---- KV write --------------------------------------------------------------------------------
def test_kv_write_skips_negative_slots_byte_exact():
    gen = torch.Generator().manual_seed(10)
    cache = torch.randn(2, 5, 16, 2, 80, generator=gen)
    cache[:, 0] = NAN                                      # null block: must stay NaN
    cache = cache.to(DEVICE)
    slots = torch.tensor([17, -1, 16 * 4 + 15, 33, -1, -1], dtype=torch.int64, device=DEVICE)
    key = torch.randn(8, 2, 80, generator=gen).to(DEVICE)  # longer than slot_mapping: rows 6, 7 unused
    value = torch.randn(8, 2, 80, generator=gen).to(DEVICE)
    before = cache.clone()
    kv_write(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    expect = before.clone()
    flat = expect.view(2, -1, 2, 80)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            flat[0, s], flat[1, s] = key[t], value[t]
    same = cache.view(torch.int32) == expect.view(torch.int32)   # bytes: NaN == NaN here
    assert same.all(), f"{int((~same).sum())} cache elements differ from the expected bytes"


def test_kernel_write_matches_the_reference_write_bytes():
    """The two KV writers (``KVWriter`` "kernel" and "reference") write the same bytes."""
    from fullgraph.attention import reference as ref_ops
    gen = torch.Generator().manual_seed(17)
    k, v = torch.randn(2, 5, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 40, 16, -1], dtype=torch.int64, device=DEVICE)
    ours = torch.randn(2, 3, 16, 2, 16, generator=gen).to(DEVICE)
    theirs = ours.clone()
    kv_write(key=k, value=v, kv_cache=ours, slot_mapping=slots)
    ref_ops.write_kv(theirs, k, v, slots)
    assert torch.equal(ours, theirs)


def test_kv_write_strided_views_of_a_fused_projection():
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=gen).to(DEVICE)
    _, k, v = qkv.split((64, 32, 32), dim=-1)
    k, v = k.view(7, 2, 16), v.view(7, 2, 16)                   # non-contiguous token stride
    cache = torch.zeros(2, 3, 16, 2, 16, device=DEVICE)
    slots = torch.arange(16, 23, dtype=torch.int64, device=DEVICE)
    kv_write(key=k, value=v, kv_cache=cache, slot_mapping=slots)
    torch.testing.assert_close(cache[0, 1, :7], k, rtol=0, atol=0)
    torch.testing.assert_close(cache[1, 1, :7], v, rtol=0, atol=0)


# ---- torch.library registration ---------------------------------------------------------------
def test_ops_trace_under_torch_compile_fullgraph():
    b = make_batch([(3, 4), (0, 1)], heads=(2, 1), head_dim=16, pad_tokens=2, pad_reqs=1, seed=12)
    cache = b.kv_cache.clone()
    cache.view(2, -1, 1, 16)[:, b.slot_mapping[: b.num_tokens]] = NAN     # kv_write must refill them

    def step(q, k, v, kv_cache, qsl, seq_lens, table, slots):
        kv_write(key=k, value=v, kv_cache=kv_cache, slot_mapping=slots)
        return paged_attention(q, kv_cache, qsl, seq_lens, table, scale=0.25, decode_only=False) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(b.q, b.k, b.v, cache, b.query_start_loc, b.seq_lens, b.block_table, b.slot_mapping)
    check(out / 2, b)
    assert torch.equal(cache.nan_to_num(7.0), b.kv_cache.nan_to_num(7.0))


def test_opcheck():
    b = make_batch([(2, 3), (5, 1)], heads=(2, 1), head_dim=16, seed=13)
    part_out, part_lse = workspaces(b, 1)
    torch.library.opcheck(torch.ops.fullgraph.paged_attention.default,
                          (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table, part_out, part_lse,
                           torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.25, False, 1, 16, 16, 1, 1))
    d = make_batch([(9, 1), (40, 1)], heads=(2, 1), head_dim=16, decode=True, seed=13)
    part_out, part_lse = workspaces(d, 3)
    torch.library.opcheck(torch.ops.fullgraph.paged_attention.default,
                          (d.q, d.kv_cache, d.query_start_loc, d.seq_lens, d.block_table, part_out, part_lse,
                           torch.zeros(2, dtype=torch.int32, device=DEVICE), 0.25, True, 3, 16, 16, 1, 1))
    cache = torch.zeros_like(b.kv_cache)
    torch.library.opcheck(torch.ops.fullgraph.kv_write.default, (b.k, b.v, cache, b.slot_mapping))


# ---- the backend --------------------------------------------------------------------------------
def make_backend(max_num_seqs=16, max_model_len=1024, page=16, heads=(4, 2), head_dim=64):
    layer = Attention(heads[0], heads[1], head_dim, scale=head_dim ** -0.5)
    limits = BackendLimits(max_num_seqs, 64, max_model_len, page, 64, DEVICE, torch.float32)
    return get_backend_class("triton")(limits, [layer]), layer


def metadata_of(b: Batch, backend) -> AttentionMetadata:
    return AttentionMetadata(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_table=b.block_table,
                             slot_mapping=b.slot_mapping, decode_only=b.decode, backends={"dense": backend})


@pytest.mark.parametrize("merge", [False, True], ids=["reduce-launch", "merged"])
@pytest.mark.parametrize("num_reqs", [1, 3, 4, 16], ids=["split", "split-small", "no-split-full", "no-split"])
def test_backend_forward_writes_then_attends(num_reqs, merge):
    """kv_write then attention from the cache, across the split-KV threshold (8 stand-in SMs),
    the splits merged by a second launch or in the attention launch (FULLGRAPH_FUSE=reduce)."""
    backend, layer = make_backend()
    if merge:
        backend.arrivals = torch.zeros(16 * 2, dtype=torch.int32, device=DEVICE)
    else:
        assert backend.arrivals is None, "the merge is opt-in (FULLGRAPH_FUSE=reduce)"
    real = min(num_reqs, 5)
    b = make_batch([(30 * i + 7, 1) for i in range(real)], heads=(4, 2), pad_tokens=num_reqs - real,
                   pad_reqs=num_reqs - real, decode=True, seed=14)
    if DEVICE.type == "cpu":
        assert (backend.num_splits(num_reqs, 2) > 1) == (num_reqs * 2 < backend.num_sms)
    full_cache = b.kv_cache.clone()
    b.kv_cache.view(2, -1, 2, 64)[:, b.slot_mapping[: b.num_tokens]] = NAN
    with poisoned_allocations():
        out = layer(b.q, b.k, b.v, b.kv_cache, metadata_of(b, backend)).view(b.q.shape)
    assert torch.equal(b.kv_cache.nan_to_num(7.0), full_cache.nan_to_num(7.0))
    check(out, b)
    assert backend.arrivals is None or not backend.arrivals.any()


def test_backend_allocates_the_counters_only_when_merging(monkeypatch):
    import fullgraph.env

    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset({"reduce"}))
    backend, _ = make_backend(max_num_seqs=16, heads=(4, 2))
    assert backend.arrivals.dtype == torch.int32 and backend.arrivals.numel() == 16 * 2
    assert not backend.arrivals.any()
    assert "arrivals" not in backend.workspaces(), "a workspace is poisoned in validate mode; the counters must stay zero"


def test_backend_decode_split_traces_under_torch_compile():
    backend, layer = make_backend()
    b = make_batch([(37, 1), (5, 1)], heads=(4, 2), pad_tokens=1, pad_reqs=1, decode=True, seed=16)
    assert backend.num_splits(3, 2) > 1
    metadata = metadata_of(b, backend)
    compiled = torch.compile(lambda q, k, v, cache: layer(q, k, v, cache, metadata).view(q.shape),
                             fullgraph=True, backend="aot_eager")
    check(compiled(b.q, b.k, b.v, b.kv_cache), b)


def test_backend_reports_unsupported():
    cls = get_backend_class("triton")
    bad_dim = [Attention(2, 1, 100, scale=0.1)]
    assert "head_dim 100" in cls.unsupported_reason(DEVICE, torch.float32, bad_dim)
    assert "dtype" in cls.unsupported_reason(DEVICE, torch.float64, [])
    with pytest.raises(ValueError, match="block_size"):
        make_backend(page=8)


def test_runner_end_to_end_matches_sdpa(monkeypatch):
    """toy-llama through the runner: triton on padded static buffers == sdpa eager, step by step
    (on the CPU with 16 stand-in SMs, so its 4-row decode step still splits the KV)."""
    monkeypatch.setattr(triton_backend, "INTERPRET_NUM_SMS", 16)

    def runner(attention, cudagraph):
        model = fullgraph.models.Llama(fullgraph.models.LlamaConfig.toy(), device=DEVICE)
        r = fullgraph.FullGraphRunner(model, attention=attention, cudagraph=cudagraph, max_num_seqs=4,
                                      max_num_tokens=64, max_model_len=512, block_size=16)
        for cache in r.kv_caches:
            cache.fill_(NAN)                          # every slot read must have been written first
        return r
    ours, ref = runner("triton", "padded"), runner("sdpa", "none")
    assert ours.config.attention == "triton"
    if DEVICE.type == "cpu":
        assert ours.backends["dense"].num_splits(4, 2) > 1, "the decode step should run split-KV"
    gen = torch.Generator().manual_seed(15)
    blocks = [ours.blocks.allocate(4) for _ in range(3)]
    assert blocks == [ref.blocks.allocate(4) for _ in range(3)]

    def chunk(i, start, n):
        return fullgraph.SeqChunk(torch.randint(0, 512, (n,), generator=gen).tolist(), start, blocks[i])
    steps = [[chunk(0, 0, 17), chunk(1, 0, 5)],
             [chunk(0, 17, 1), chunk(1, 5, 14), chunk(2, 0, 1)],
             [chunk(0, 18, 1), chunk(1, 19, 1), chunk(2, 1, 1)],
             [chunk(2, 2, 30), chunk(0, 19, 1)]]
    for chunks in steps:
        a, e = ours.step(chunks), ref.step(chunks)
        assert a.mode == "padded" and not a.logits.isnan().any()
        torch.testing.assert_close(a.logits, e.logits, atol=1e-4, rtol=1e-4)


# ---- GPU: bf16 accuracy, split-KV, CUDA-graph capture ------------------------------------------
def assert_flash_rule(out: torch.Tensor, b: Batch, floor: float = 1e-4) -> None:
    """Kernel error vs fp64 <= 2x PyTorch's own error in the same dtype, plus a small floor."""
    exact = reference(b)[: b.num_tokens]
    ours = (out[: b.num_tokens].double() - exact).abs().max().item()
    torch_err = (reference(b, dtype=b.q.dtype)[: b.num_tokens].double() - exact).abs().max().item()
    assert not out.isnan().any()
    assert ours <= 2 * torch_err + floor, f"kernel error {ours:.3g} vs PyTorch {b.q.dtype} error {torch_err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_bf16_mixed(head_dim, page):
    b = make_batch([(0, 300), (700, 129), (1000, 1), (33, 1), (64, 64)], heads=(8, 2), head_dim=head_dim,
                   page=page, pad_tokens=11, pad_reqs=3, dtype=torch.bfloat16, seed=20)
    assert_flash_rule(run(b), b)


@gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(32, 8), (9, 3)])
def test_gpu_bf16_decode_unsplit_long_programs(heads):
    """One split over whole sequences at head_dim 64: the long-program launch config (128-key tiles,
    three stages) over pages that end mid-tile and padded rows."""
    b = make_batch([(c, 1) for c in (5000, 1, 127, 2049, 4000, 63)], heads=heads, head_dim=64, pad_tokens=2,
                   pad_reqs=2, decode=True, dtype=torch.bfloat16, seed=23)
    span = b.block_table.shape[1] * b.kv_cache.shape[2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = b.block_table.shape[0] * heads[1] / sms
    assert span >= LONG_PROGRAM_KEYS and default_config(64, torch.bfloat16, True, span, per_sm).block_n == 128
    assert_flash_rule(run(b, num_sms=sms), b)


@gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (28, 4)])
def test_gpu_bf16_decode_split_on_off(heads):
    b = make_batch([(c, 1) for c in (1, 100, 2047, 5000, 17)], heads=heads, head_dim=128, pad_tokens=3,
                   pad_reqs=3, decode=True, dtype=torch.bfloat16, seed=21)
    plain = run(b)
    assert_flash_rule(plain, b)
    splits = num_kv_splits(8, heads[1], 8192, torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits > 1
    part_out, part_lse = workspaces(b, splits)
    two = run(b, num_splits=splits, part_out=part_out, part_lse=part_lse)
    assert_flash_rule(two, b)
    arrivals = torch.zeros(8 * heads[1], dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        merged = run(b, num_splits=splits, part_out=part_out, part_lse=part_lse, arrivals=arrivals)
        assert_flash_rule(merged, b)
        torch.testing.assert_close(merged, two, atol=0, rtol=0)
        assert not arrivals.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("decode, merge", [(True, False), (True, True), (False, False)],
                         ids=["decode", "decode-merged", "mixed"])
def test_gpu_cuda_graph_replay_with_new_lengths(decode, merge):
    """Capture kv_write + attention once at short lengths; replay with other seq_lens/slots."""
    page, width, heads, dim = 16, 72, (8, 2), 128
    num_reqs = 4
    num_tokens = num_reqs if decode else 48
    layouts = [[(3, 1), (0, 1), (15, 1), (1, 1)]] if decode else [[(3, 10), (0, 1), (15, 20), (1, 2)]]
    layouts += [[(1000, 1), (16, 1), (0, 1), (500, 1)], [(7, 1), (1022, 1), (63, 1), (64, 1)]] if decode else \
        [[(1000, 17), (16, 1), (0, 12), (500, 5)], [(7, 1), (990, 33), (63, 1), (64, 1)]]
    batches = [make_batch(reqs, heads=heads, head_dim=dim, page=page, pad_tokens=num_tokens - sum(n for _, n in reqs),
                          decode=decode, dtype=torch.bfloat16, seed=30 + i) for i, reqs in enumerate(layouts)]
    num_blocks = max(x.kv_cache.shape[1] for x in batches)
    static = make_batch(layouts[0], heads=heads, head_dim=dim, page=page, decode=decode, dtype=torch.bfloat16,
                        pad_tokens=num_tokens - sum(n for _, n in layouts[0]), seed=30)
    cache = torch.zeros(2, num_blocks, page, heads[1], dim, dtype=static.q.dtype, device=DEVICE)
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=DEVICE)
    splits = num_kv_splits(num_reqs, heads[1], width * page, torch.cuda.get_device_properties(0).multi_processor_count) \
        if decode else 1
    assert splits > 1 or not decode
    part_out, part_lse = workspaces(static, splits)
    arrivals = torch.zeros(num_reqs * heads[1], dtype=torch.int32, device=DEVICE) if merge else None

    def load(x: Batch) -> None:
        cache.zero_()
        cache[:, : x.kv_cache.shape[1]].copy_(x.kv_cache.nan_to_num(0.0))
        cache.view(2, -1, heads[1], dim)[:, x.slot_mapping[: x.num_tokens]] = 0   # the graph writes them
        table.zero_()
        table[:, : x.block_table.shape[1]].copy_(x.block_table)
        for dst, src in ((static.q, x.q), (static.k, x.k), (static.v, x.v), (static.query_start_loc, x.query_start_loc),
                         (static.seq_lens, x.seq_lens), (static.slot_mapping, x.slot_mapping)):
            dst.copy_(src)

    def body():
        kv_write(key=static.k, value=static.v, kv_cache=cache, slot_mapping=static.slot_mapping)
        return paged_attention(static.q, cache, static.query_start_loc, static.seq_lens, table, scale=dim ** -0.5,
                               decode_only=decode, num_splits=splits, part_out=part_out, part_lse=part_lse,
                               arrivals=arrivals)
    load(batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()                                              # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    for x in batches[1:] + batches[:1]:
        load(x)
        graph.replay()
        torch.cuda.synchronize()
        assert_flash_rule(out.clone(), x)       # x's own cache: also checks what kv_write wrote
        assert arrivals is None or not arrivals.any()
