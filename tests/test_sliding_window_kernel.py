"""Sliding-window paged attention (``paged_attention(..., window=W)``) against a float64 reference.

CPU: the kernel runs under ``TRITON_INTERPRET=1`` in float32 on small shapes. Every cache slot no
query of its request may see (``k < first query position - W + 1``) is NaN, and pages made only
of such slots are dropped from the block table (entry 0: the null block, also NaN), as an engine
that frees pages leaving the window would do: a skipped or masked page reaching an output row
shows up as NaN. The reference is written here: gather the pages, mask ``k <= q and q - k < W``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fullgraph.kernels.paged_attention import KernelConfig, KeysRead, keys_read, paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")
PAGE = 16
TILE16 = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # one key tile per page


@dataclass
class Step:
    """One step's inputs; ``num_tokens`` real tokens, the padded rows of q are NaN."""

    q: torch.Tensor                # (T, H, D)
    kv_cache: torch.Tensor         # (2, NB, PAGE, KVH, D)
    query_start_loc: torch.Tensor  # (R + 1,) int32, tail repeats the last real value
    seq_lens: torch.Tensor         # (R,) int32, padded requests 0
    block_table: torch.Tensor      # (R, MB) int32
    num_tokens: int
    decode: bool

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_step(reqs, window: int, *, heads=(4, 2), head_dim=32, pad_tokens=0, pad_reqs=0, decode=False,
              seed=0, dtype=torch.float32) -> Step:
    """``reqs``: (context_len, query_len) per request. Only the slots some query sees hold data."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    pages_of = [-(-(c + n) // PAGE) for c, n in reqs]
    num_blocks = sum(pages_of) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv = torch.full((2, num_blocks, PAGE, num_kv_heads, head_dim), NAN)
    table = torch.zeros(len(reqs) + pad_reqs, max(pages_of) + 1, dtype=torch.int32)
    qsl, seq_lens = [0], []
    for r, ((ctx, n), npages) in enumerate(zip(reqs, pages_of)):
        first = max(ctx - window + 1, 0) if window else 0     # first position any query of r sees
        ids = torch.tensor([order.pop() for _ in range(npages)], dtype=torch.int32)
        pos = torch.arange(first, ctx + n)
        kv[:, ids[pos // PAGE], pos % PAGE] = torch.randn(2, len(pos), num_kv_heads, head_dim, generator=gen)
        table[r, :npages] = ids
        table[r, : first // PAGE] = 0                        # pages wholly outside: freed
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens + pad_tokens, num_heads, head_dim, generator=gen)
    q[num_tokens:] = NAN
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return Step(q.to(DEVICE, dtype), kv.to(DEVICE, dtype), torch.tensor(qsl + [num_tokens] * pad_reqs, **i32),
                torch.tensor(seq_lens + [0] * pad_reqs, **i32), table.to(DEVICE), num_tokens, decode)


def reference(s: Step, window: int, dtype=torch.float64) -> torch.Tensor:
    """Attention of each real request: position q sees key k iff k <= q and q - k < window."""
    num_heads, head_dim = s.q.shape[1:]
    num_kv_heads = s.kv_cache.shape[3]
    out = torch.zeros(s.num_tokens, num_heads, head_dim, dtype=dtype, device=s.q.device)
    qsl, seq_lens, table = s.query_start_loc.tolist(), s.seq_lens.tolist(), s.block_table.tolist()
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        if end <= start:
            continue
        pages = table[r][: -(-seq_len // PAGE)]
        kv = s.kv_cache[:, pages].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len].to(dtype)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=out.device)[:, None]
        k_pos = torch.arange(seq_len, device=out.device)[None, :]
        keep = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)  # (q, L)
        seen = keep.any(0)
        assert kv[:, seen].isfinite().all(), "the test poisoned a key some query sees"
        k, v = torch.where(seen[None, :, None, None], kv, 0.0).repeat_interleave(num_heads // num_kv_heads, dim=2)
        scores = torch.einsum("qhd,khd->hqk", s.q[start:end].to(dtype), k) * s.scale
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1).to(dtype)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def run(s: Step, **kwargs) -> torch.Tensor:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)   # torch.empty fills NaN: unwritten rows show
    try:
        return paged_attention(s.q, s.kv_cache, s.query_start_loc, s.seq_lens, s.block_table,
                               scale=s.scale, decode_only=s.decode, **kwargs)
    finally:
        torch.use_deterministic_algorithms(before)


def workspaces(s: Step, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = s.block_table.shape[0] * splits * s.q.shape[1]
    pad = 1 << (s.q.shape[-1] - 1).bit_length()
    return torch.full((rows * pad,), NAN, device=DEVICE), torch.full((rows,), NAN, device=DEVICE)


def check(out: torch.Tensor, s: Step, window: int) -> None:
    assert out.shape == s.q.shape and out.dtype == s.q.dtype
    assert not out.isnan().any(), "a skipped or masked page reached an output row, or a row was not written"
    torch.testing.assert_close(out[: s.num_tokens].double(), reference(s, window), atol=2e-5, rtol=1e-5)
    assert (out[s.num_tokens:] == 0).all(), "padded token rows must be zeros"


def test_window_rule_is_transformers_sliding_window():
    masking = pytest.importorskip("transformers.masking_utils")
    window, n = 5, 12
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    theirs = masking.sliding_window_causal_mask_function(window)(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    assert torch.equal(theirs, (kv_idx <= q_idx) & (q_idx - kv_idx < window))
    assert int(theirs[n - 1].sum()) == window, "the last `window` positions, its own included"


@pytest.mark.parametrize("window", [8, 16, 32])
def test_prefill_crosses_window_edge(window):
    s = make_step([(0, 70), (0, window + 1), (0, window), (0, 3)], window, seed=1)
    check(run(s, window=window), s, window)


@pytest.mark.parametrize("window", [8, 16, 32])
def test_chunked_prefill_context_starts_mid_window(window):
    """Cached context longer than the window: its early pages are freed, later ones partly seen."""
    s = make_step([(20, 13), (37, 30), (5, 9), (70, 1), (45, 2)], window, pad_tokens=3, pad_reqs=1, seed=2)
    assert (s.block_table[3, :2] == 0).all(), "pages before the window should be dropped"
    check(run(s, window=window), s, window)


@pytest.mark.parametrize("config", [None, TILE16], ids=["tile32", "tile16"])
@pytest.mark.parametrize("window", [8, 16, 32])
def test_decode_around_window_edge_and_long_context(window, config):
    """seq_len just below, at and past the window, two windows, and 300 tokens (most pages freed)."""
    lens = [window - 1, window, window + 1, 2 * window + 1, 300]
    s = make_step([(n - 1, 1) for n in lens], window, pad_tokens=2, pad_reqs=2, decode=True, seed=3)
    assert int((s.block_table[4, : 300 // PAGE] == 0).sum()) == (300 - window) // PAGE, "freed pages"
    check(run(s, window=window, config=config), s, window)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "g3"])
def test_mixed_step(heads):
    """Decode tokens, a fresh prefill longer than the window and chunks with context, padded T and R."""
    window = 16
    s = make_step([(40, 1), (0, 37), (21, 12), (5, 1), (100, 20), (15, 1)], window, heads=heads,
                  pad_tokens=5, pad_reqs=2, seed=4)
    check(run(s, window=window), s, window)
    check(run(s, window=window, config=TILE16), s, window)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_decode_divides_only_the_window(splits):
    """Splits cover the window's tiles only: every split up to the window's tile count has keys
    (finite lse); the rest are empty (lse -inf) and still merge to the unsplit result."""
    window, lens = 16, [300, 17, 16, 5, 1]
    s = make_step([(n - 1, 1) for n in lens], window, pad_tokens=1, pad_reqs=1, decode=True, seed=5)
    part_out, part_lse = workspaces(s, splits)
    out = run(s, window=window, config=TILE16, num_splits=splits, part_out=part_out, part_lse=part_lse)
    check(out, s, window)
    torch.testing.assert_close(out, run(s, window=window, config=TILE16), atol=1e-5, rtol=1e-5)
    lse = part_lse.view(len(lens) + 1, splits, s.q.shape[1])
    for r, read in enumerate(keys_read(lens, window, 16)):
        tiles = -(-read.walked // 16)
        used = -(-tiles // -(-tiles // splits))              # splits that get a tile of the window
        assert lse[r, :used].isfinite().all() and (lse[r, used:] == -math.inf).all(), (r, lens[r], splits)
    assert (lse[len(lens)] == -math.inf).all(), "a padded request has no keys"


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "split-decode"])
def test_window_zero_is_full_causal_bitwise(decode):
    """window=0, no window argument, a window covering every sequence (the windowed code path) and
    one covering the whole block table (the causal path again) give the same bits."""
    reqs = [(40, 1), (0, 37), (21, 12), (5, 1)] if not decode else [(c, 1) for c in (0, 15, 40, 95)]
    s = make_step(reqs, 0, pad_tokens=1, pad_reqs=1, decode=decode, seed=6)
    splits = 3 if decode else 1
    kw = dict(num_splits=splits, part_out=None, part_lse=None)
    outs = []
    longest, table_len = max(c + n for c, n in reqs), s.block_table.shape[1] * PAGE
    for extra in ({}, {"window": 0}, {"window": longest}, {"window": table_len}):
        if decode:
            kw["part_out"], kw["part_lse"] = workspaces(s, splits)
        outs.append(run(s, **kw, **extra))
    check(outs[0], s, 0)
    assert all(torch.equal(outs[0], other) for other in outs[1:])


def test_keys_read_matches_the_window():
    got = keys_read([1, 15, 16, 17, 40, 300], 16, 32)
    assert [r.loaded for r in got] == [1, 15, 16, 16, 16, 16]
    assert [r.dense for r in got] == [1, 15, 16, 17, 40, 300]
    assert [r.walked for r in got] == [1, 15, 16, 17, 40, 300 - 256]   # 300 - 16 = 284 lies in tile 256
    assert keys_read([300], 0, 32) == [KeysRead(300, 300, 300)]
    assert keys_read([300], 16, 16) == [KeysRead(16, 28, 300)]           # tiles from 272 (284 // 16 * 16)


def test_traces_under_torch_compile_fullgraph():
    window = 8
    s = make_step([(20, 5), (30, 1)], window, heads=(2, 1), head_dim=16, pad_tokens=2, pad_reqs=1, seed=7)

    def step(q, kv_cache, qsl, seq_lens, table):
        return paged_attention(q, kv_cache, qsl, seq_lens, table, scale=0.25, decode_only=False, window=window)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(s.q, s.kv_cache, s.query_start_loc, s.seq_lens, s.block_table)
    assert torch.equal(out, step(s.q, s.kv_cache, s.query_start_loc, s.seq_lens, s.block_table))
    part = torch.empty(0, device=DEVICE)
    torch.library.opcheck(torch.ops.fullgraph.paged_attention.default,
                          (s.q, s.kv_cache, s.query_start_loc, s.seq_lens, s.block_table, part,
                           part, torch.empty(0, dtype=torch.int32, device=DEVICE), 0.25, False, 1, 16, 16, 1, 1,
                           window))


@pytest.mark.parametrize("window", [-1, 2.0, "16"])
def test_bad_window_raises(window):
    s = make_step([(3, 2)], 0, seed=8)
    with pytest.raises(ValueError, match="window"):
        run(s, window=window)


# ---- GPU: bf16 accuracy and CUDA-graph replay ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("decode", [True, False], ids=["split-decode", "mixed"])
def test_gpu_bf16_window_cuda_graph_replay(decode):
    """Captured once, replayed with other lengths; error vs float64 <= 2x PyTorch's own bf16 error."""
    window, heads, dim, num_reqs, width = 64, (8, 2), 128, 4, 80
    layouts = [[(3, 1), (0, 1), (70, 1), (1, 1)], [(1000, 1), (64, 1), (0, 1), (500, 1)],
               [(63, 1), (1200, 1), (65, 1), (200, 1)]]
    if not decode:
        layouts = [[(c, n) for (c, _), n in zip(reqs, (30, 1, 17, 100))] for reqs in layouts]
    steps = [make_step(reqs, window, heads=heads, head_dim=dim, decode=decode, seed=20 + i, dtype=torch.bfloat16)
             for i, reqs in enumerate(layouts)]
    static = make_step(layouts[0], window, heads=heads, head_dim=dim, decode=decode, seed=20, dtype=torch.bfloat16)
    cache = torch.zeros(2, max(x.kv_cache.shape[1] for x in steps), PAGE, heads[1], dim, dtype=torch.bfloat16,
                        device=DEVICE)
    static.kv_cache, static.block_table = cache, torch.zeros(num_reqs, width, dtype=torch.int32, device=DEVICE)
    splits = 4 if decode else 1
    part_out, part_lse = workspaces(static, splits)

    def load(x: Step) -> None:
        cache.fill_(NAN)
        cache[:, : x.kv_cache.shape[1]].copy_(x.kv_cache)
        static.block_table.zero_()
        static.block_table[:, : x.block_table.shape[1]].copy_(x.block_table)
        for dst, src in ((static.q, x.q), (static.query_start_loc, x.query_start_loc), (static.seq_lens, x.seq_lens)):
            dst.copy_(src)

    def body():
        return run(static, window=window, num_splits=splits, part_out=part_out, part_lse=part_lse)
    load(steps[0])
    body()                                                   # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    for x in steps[1:] + steps[:1]:
        load(x)
        graph.replay()
        exact = reference(x, window)
        ours = (out.double() - exact).abs().max().item()
        theirs = (reference(x, window, torch.bfloat16).double() - exact).abs().max().item()
        assert not out.isnan().any() and ours <= 2 * theirs + 1e-4, (ours, theirs)
