"""The ``sdpa`` backend's decode-only fast path against its general path (already checked in float64).

Every case poisons with NaN what a real request must never read: the null block, the unused
slots of its own last page past ``seq_len`` and the pages it does not own. Padded requests have
``seq_len`` 0, null block-table rows and slot -1, as the padding policy lays them out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fullgraph.attention import Attention, AttentionMetadata
from fullgraph.attention import reference as ref_ops
from fullgraph.attention.backends import BackendLimits
from fullgraph.attention.backends.sdpa import SdpaBackend

BLOCK, NUM_BLOCKS, MAX_BLOCKS, DIM = 16, 48, 9, 16
SCALE = DIM ** -0.5


@dataclass
class Step:
    q: torch.Tensor                # (R, H, D)
    k: torch.Tensor                # (R, KVH, D), the new token's key
    v: torch.Tensor
    seq_lens: torch.Tensor         # (R,) int32; 0 for padded requests
    block_table: torch.Tensor      # (R, MB) int32; null rows for padded requests
    slot_mapping: torch.Tensor     # (R,) int64; -1 for padded requests
    query_start_loc: torch.Tensor  # (R + 1,) int32
    num_reqs: int                  # real requests (the first ones)


def make_cache(kv_heads: int, dtype=torch.float32) -> torch.Tensor:
    """Random everywhere except the NaN null block; slots a request does not own are poisoned by
    ``make_step``."""
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, DIM, dtype=dtype)
    cache[:, 0] = float("nan")
    return cache


def make_step(rng: np.random.Generator, cache: torch.Tensor, seq_lens: list[int], pad: int, heads: int) -> Step:
    """One decode token per request at position seq_len - 1; ``pad`` padded requests follow."""
    kv_heads = cache.shape[3]
    pool = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    num_reqs = len(seq_lens) + pad
    table = torch.zeros(num_reqs, MAX_BLOCKS, dtype=torch.int32)
    slots = torch.full((num_reqs,), -1, dtype=torch.int64)
    flat = cache.view(2, -1, kv_heads, DIM)
    for r, n in enumerate(seq_lens):
        blocks = [int(pool.pop()) for _ in range(-(-n // BLOCK))]
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots[r] = blocks[-1] * BLOCK + (n - 1) % BLOCK
        flat[:, slots[r] + 1: (blocks[-1] + 1) * BLOCK] = float("nan")  # own page, past seq_len
    for b in pool:                                                         # pages nobody owns
        cache[:, b] = float("nan")
    lens = torch.tensor(seq_lens + [0] * pad, dtype=torch.int32)
    qsl = torch.cat([torch.arange(len(seq_lens) + 1), torch.full((pad,), len(seq_lens))]).to(torch.int32)
    q, k, v = (torch.randn(num_reqs, h, DIM, dtype=cache.dtype) for h in (heads, kv_heads, kv_heads))
    return Step(q, k, v, lens, table, slots, qsl, len(seq_lens))


def general(step: Step, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The general path on a copy of the cache, the reference: (output, cache after the write)."""
    cache = cache.clone()
    ref_ops.write_kv(cache, step.k, step.v, step.slot_mapping)
    return ref_ops.paged_attention(step.q, cache, step.query_start_loc, step.seq_lens, step.block_table,
                                     scale=SCALE, decode_only=False), cache


def fast(step: Step, cache: torch.Tensor, variant: tuple[str, str]) -> torch.Tensor:
    """The fast path with ``variant`` = (gather, attention), writing into ``cache``."""
    gather, attention = variant
    ref_ops.write_kv_indexed(cache, step.k, step.v, *ref_ops.write_index(step.slot_mapping))
    index, bias = ref_ops.decode_index(step.seq_lens, step.block_table, BLOCK, cache.shape[3],
                                       NUM_BLOCKS * BLOCK, cache.dtype, gather)
    return ref_ops.decode_attention_op(step.q, cache, index, bias, SCALE, gather, attention)


@pytest.fixture(params=ref_ops.DECODE_GATHERS)
def gather(request) -> str:
    return request.param


@pytest.fixture(params=ref_ops.DECODE_ATTENTIONS)
def variant(request, gather) -> tuple[str, str]:
    """Every (gather, attention) pair of the decode fast path."""
    return gather, request.param


LENGTHS = {
    "page_edges": [1, 15, 16, 17],
    "long": [97, 144, 2, 33],
    "one": [1],
    "full_table": [MAX_BLOCKS * BLOCK, 31],
}


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("pad", [0, 3])
def test_fast_path_matches_general_path(variant, heads, kv_heads, lengths, pad):
    rng = np.random.default_rng([heads, kv_heads, len(lengths), pad])
    cache = make_cache(kv_heads)
    step = make_step(rng, cache, LENGTHS[lengths], pad, heads)
    want, written = general(step, cache)
    got = fast(step, cache, variant)
    assert torch.equal(cache.view(torch.int32), written.view(torch.int32)), "the KV writes differ"
    assert torch.isfinite(got).all(), "NaN reached a row (real, or padded: those read request 0's key 0)"
    real = step.num_reqs
    assert torch.isfinite(want[:real]).all()
    torch.testing.assert_close(got[:real], want[:real], atol=1e-5, rtol=1e-5)


def test_fast_path_reads_the_new_token(variant):
    """The token written this step is the last key: changing it changes the output."""
    rng = np.random.default_rng(7)
    cache = make_cache(2)
    step = make_step(rng, cache, [17, 1], 0, 4)
    before = fast(step, cache.clone(), variant)
    step.v += 1.0
    after = fast(step, cache.clone(), variant)
    assert (after - before).abs().amin(-1).gt(1e-3).all()


def test_bf16_fast_path_close_to_general_path(variant):
    rng = np.random.default_rng(11)
    cache = make_cache(2, torch.bfloat16)
    step = make_step(rng, cache, [1, 16, 97, 40], 2, 8)
    want = general(step, cache)[0][: step.num_reqs].float()
    got = fast(step, cache, variant)
    assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[: step.num_reqs].float(), want, atol=3e-2, rtol=3e-2)


def test_decode_index_masks_and_never_points_at_unwritten_slots(gather):
    seq_lens = torch.tensor([1, 17, 0], dtype=torch.int32)
    table = torch.tensor([[5, 0, 0], [7, 9, 0], [0, 0, 0]], dtype=torch.int32)
    num_slots = 12 * 16
    index, bias = ref_ops.decode_index(seq_lens, table, 16, 2, num_slots, torch.float32, gather)
    assert index.dtype == torch.int64 and bias.shape == (6, 48)
    if gather == "slots":      # (K or V, key, request) -> row of kv_cache.view(2 * num_slots, KVH * D)
        assert index.shape == (2, 48, 3) and index.is_contiguous()
        assert torch.equal(index[1] - index[0], torch.full((48, 3), num_slots))
        slots = index[0].t()[:, None, :].expand(3, 2, 48)              # (R, KVH, L), every head alike
    else:                      # (request, head, key) -> row of kv_cache.view(2, -1, D)
        assert index.shape == (3, 2, 48)
        slots, heads = index // 2, index % 2
        assert (heads == torch.arange(2)[None, :, None]).all()
    assert slots[0].unique().tolist() == [5 * 16]                      # only key 0, then repeats of it
    assert slots[1, 0, :17].tolist() == list(range(7 * 16, 8 * 16)) + [9 * 16]
    assert (slots[1, :, 17:] == 9 * 16).all()                          # past seq_len: own newest position 16
    assert (slots[2] == 5 * 16).all()                                  # padded: request 0's newest (0)
    keep = bias.view(3, 2, 48) == 0
    assert keep.sum(-1).tolist() == [[1, 1], [17, 17], [1, 1]]
    assert torch.isneginf(bias.view(3, 2, 48)[~keep]).all()


def test_slots_gather_is_one_flat_index_and_copies_nothing_else():
    """The layout CUDA's vectorized gather needs: one contiguous int64 index into a 2-D view whose
    rows are whole slots; K and V come back as views of that one result (no copy per layer)."""
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, 2, DIM)
    step = make_step(np.random.default_rng(3), cache, [5, 40], 1, 4)
    index, _ = ref_ops.decode_index(step.seq_lens, step.block_table, BLOCK, 2, NUM_BLOCKS * BLOCK,
                                      cache.dtype, "slots")
    k, v = ref_ops._gather(cache, index, "slots")
    assert k.shape == v.shape == (3 * 2, MAX_BLOCKS * BLOCK, DIM)
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.stride() == (DIM, 3 * 2 * DIM, 1)                         # (R*KVH, L, D) over (L, R*KVH, D)
    flat = cache.view(2, -1, 2, DIM)
    slots = index[0]                                                   # (L, R)
    for r, h, key in [(0, 1, 0), (1, 0, 39), (1, 1, 100), (2, 0, 7)]:
        assert torch.equal(k[r * 2 + h, key], flat[0, slots[key, r], h])
        assert torch.equal(v[r * 2 + h, key], flat[1, slots[key, r], h])


def test_write_kv_indexed_byte_identity_with_minus_one_slots():
    """Shared index, two layers: real slots get the new values, every other byte stays put."""
    safe, valid = ref_ops.write_index(torch.tensor([37, -1, 5, -1]))
    for _ in range(2):
        cache = torch.randn(2, 4, 16, 2, 8)
        cache[:, 0] = float("nan")
        before = cache.clone()
        k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
        ref_ops.write_kv_indexed(cache, k, v, safe, valid)
        flat, old = cache.view(2, -1, 2, 8), before.view(2, -1, 2, 8)
        assert torch.equal(flat[0, 37], k[0]) and torch.equal(flat[1, 5], v[2])
        untouched = [s for s in range(64) if s not in (37, 5)]
        assert torch.equal(flat[:, untouched].view(torch.int32), old[:, untouched].view(torch.int32))


def backend_layers(num_layers: int, heads: int, kv_heads: int, gather: str = "slots"):
    limits = BackendLimits(8, 64, MAX_BLOCKS * BLOCK, BLOCK, NUM_BLOCKS, torch.device("cpu"), torch.float32)
    layers = [Attention(heads, kv_heads, DIM, SCALE) for _ in range(num_layers)]
    backend = type("SdpaVariant", (SdpaBackend,), {"decode_gather": gather})  # a variant, unregistered
    return backend(limits, layers), layers


def backend_step(backend, layers, caches, step: Step, decode_only: bool) -> list[torch.Tensor]:
    """One step through every layer with ONE metadata, as the runner builds it."""
    md = AttentionMetadata(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_table=step.block_table,
                           slot_mapping=step.slot_mapping, decode_only=decode_only, backends={"dense": backend})
    return [layer(step.q, step.k, step.v, cache, md) for layer, cache in zip(layers, caches)]


def test_backend_builds_the_step_index_once_for_all_layers(monkeypatch):
    backend, layers = backend_layers(3, 4, 2)
    rng = np.random.default_rng(5)
    caches = [make_cache(2) for _ in layers]
    step = make_step(rng, caches[0], [3, 40, 16], 1, 4)
    for cache in caches[1:]:
        cache.copy_(caches[0])
    want = [general(step, cache)[0][: step.num_reqs] for cache in caches]
    calls = {"decode_index": 0, "write_index": 0}
    for name in calls:
        def counted(*args, _fn=getattr(ref_ops, name), _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(ref_ops, name, counted)
    got = backend_step(backend, layers, caches, step, decode_only=True)
    assert calls == {"decode_index": 1, "write_index": 1}
    for g, w in zip(got, want):
        torch.testing.assert_close(g.view(-1, 4, DIM)[: step.num_reqs], w, atol=1e-5, rtol=1e-5)


def test_backend_compiled_matches_eager_and_shares_the_index(gather):
    """``torch.compile(fullgraph=True, dynamic=True)``: the step index is one node feeding every
    layer, the ops stay opaque, and the result equals eager."""
    backend, layers = backend_layers(2, 4, 2, gather)
    graphs = []

    def count_backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def step_fn(q, k, v, qsl, seq_lens, table, slots, cache0, cache1):
        md = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                               decode_only=True, backends={"dense": backend})
        return [layer(q, k, v, c, md) for layer, c in zip(layers, (cache0, cache1))]

    compiled = torch.compile(step_fn, fullgraph=True, dynamic=True, backend=count_backend)
    rng = np.random.default_rng(9)
    compiles = []
    for lengths in ([5, 17, 64], [1, 2, 3, 130]):
        base = make_cache(2)
        step = make_step(rng, base, lengths, 2, 4)
        args = (step.q, step.k, step.v, step.query_start_loc, step.seq_lens, step.block_table, step.slot_mapping)
        eager_caches, compiled_caches = [base.clone(), base.clone()], [base.clone(), base.clone()]
        want = step_fn(*args, *eager_caches)
        got = compiled(*args, *compiled_caches)
        compiles.append(len(graphs))
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g[: step.num_reqs], w[: step.num_reqs], atol=1e-5, rtol=1e-5)
        for g, w in zip(compiled_caches, eager_caches):
            assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    assert compiles[0] == compiles[1], "another batch size recompiled"
    targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op in ("call_function", "call_method")]
    assert sum("reference_decode_index" in t for t in targets) == 1
    assert sum("paged_decode_reference" in t for t in targets) == 2
    assert sum("write_kv_indexed" in t for t in targets) == 2
    assert targets.count("clamp") == 1                          # write_index: once, shared


def test_ops_pass_opcheck(gather):
    rng = np.random.default_rng(13)
    cache = make_cache(2)
    step = make_step(rng, cache, [17, 3], 1, 4)
    cache = torch.nan_to_num(cache)  # opcheck compares runs with NaN != NaN
    args = (step.seq_lens, step.block_table, BLOCK, 2, NUM_BLOCKS * BLOCK, torch.float32, gather)
    index, bias = ref_ops.decode_index(*args)
    safe, valid = ref_ops.write_index(step.slot_mapping)
    torch.library.opcheck(torch.ops.fullgraph.reference_decode_index.default, args)
    for attention in ("matmul", "matmul_keys", "sdpa"):
        torch.library.opcheck(torch.ops.fullgraph.paged_decode_reference.default,
                              (step.q, cache, index, bias, SCALE, gather, attention))
    torch.library.opcheck(torch.ops.fullgraph.write_kv_indexed.default, (cache, step.k, step.v, safe, valid))
