"""The plain-PyTorch paged path (``sdpa`` backend) against a float64 reference written here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.attention import reference as ref_ops
from fullgraph.padding import PaddingPolicy, get_policy

CFG = fg.RunnerConfig(max_num_seqs=8, max_num_tokens=256, max_model_len=160, block_size=16, num_blocks=64)


def reference(q, k_ctx, v_ctx, starts, q_lens, scale):
    """float64 causal attention per request. k_ctx/v_ctx: per request (seq_len, KVH, D)."""
    outs, t = [], 0
    for r, (start, n) in enumerate(zip(starts, q_lens)):
        qr = q[t: t + n].double()                                    # (n, H, D)
        group = qr.shape[1] // k_ctx[r].shape[1]
        k = k_ctx[r].double().repeat_interleave(group, dim=1)         # (S, H, D)
        v = v_ctx[r].double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        pos_q = start + torch.arange(n)[:, None]
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        t += n
    return torch.cat(outs)


def build_case(rng, lens, heads=4, kv_heads=2, dim=16):
    """Random requests (start_pos, q_len); context K/V already in the cache, new K/V to write."""
    cache = torch.randn(2, CFG.num_blocks, CFG.block_size, kv_heads, dim)
    cache[:, 0] = float("nan")                                       # the null block, poisoned
    pool = list(rng.permutation(np.arange(1, CFG.num_blocks)))
    chunks, k_all, v_all = [], [], []
    for start, n in lens:
        blocks = [int(pool.pop()) for _ in range(-(-(start + n) // CFG.block_size))]
        chunks.append(fg.SeqChunk(rng.integers(0, 9, n).tolist(), start, blocks))
    total = sum(n for _, n in lens)
    q = torch.randn(total, heads, dim)
    k_new, v_new = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    t = 0
    for c, (start, n) in zip(chunks, lens):
        slots = [c.block_ids[p // CFG.block_size] * CFG.block_size + p % CFG.block_size for p in range(start + n)]
        flat = cache.view(2, -1, kv_heads, dim)
        k_ctx, v_ctx = flat[0, slots].clone(), flat[1, slots].clone()
        k_ctx[start:], v_ctx[start:] = k_new[t: t + n], v_new[t: t + n]
        k_all.append(k_ctx)
        v_all.append(v_ctx)
        t += n
    return cache, chunks, q, k_new, v_new, k_all, v_all


def run_planned(plan, cache, q, k_new, v_new, scale):
    t = plan.num_tokens_padded

    def pad(x):
        return torch.cat([x, torch.full((t - x.shape[0], *x.shape[1:]), float("nan"))])
    q, k_new, v_new = pad(q), pad(k_new), pad(v_new)                 # padded rows are NaN too
    ref_ops.write_kv(cache, k_new, v_new, torch.from_numpy(plan.slot_mapping))
    return ref_ops.paged_attention(
        q, cache, torch.from_numpy(plan.query_start_loc), torch.from_numpy(plan.seq_lens),
        torch.from_numpy(plan.block_table), scale=0.25, decode_only=plan.decode_only)[: plan.num_tokens]


CASES = {
    "prefill": [(0, 17), (0, 1), (0, 97)],
    "chunked_with_context": [(15, 17), (32, 16), (100, 3)],
    "decode": [(15, 1), (16, 1), (0, 1), (140, 1)],
    "mixed": [(40, 1), (0, 33), (17, 15), (63, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pad", [True, False])
def test_paged_attention_matches_float64(case, pad):
    rng = np.random.default_rng(len(case))
    cache, chunks, q, k_new, v_new, k_all, v_all = build_case(rng, CASES[case])
    plan = fg.plan_step(chunks, CFG, get_policy("sdpa"), pad=pad)
    got = run_planned(plan, cache, q, k_new, v_new, 0.25)
    want = reference(q, k_all, v_all, [c.start_pos for c in chunks], [len(c.token_ids) for c in chunks], 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_minus_one_query_start_loc_padding_gives_wrong_rows():
    """SCENARIOS 2: the binary search over query_start_loc needs the policy's repeat-last tail."""
    rng = np.random.default_rng(3)
    cache, chunks, q, k_new, v_new, k_all, v_all = build_case(rng, [(0, 5), (7, 3), (0, 6)])
    want = reference(q, k_all, v_all, [0, 7, 0], [5, 3, 6], 0.25)
    bad = PaddingPolicy("minus_one", reads=frozenset(), tails={"query_start_loc": -1})
    results = {}
    for name, policy in (("policy", get_policy("sdpa")), ("minus_one", bad)):
        plan = fg.plan_step(chunks, CFG, policy)
        assert plan.num_reqs_padded > plan.num_reqs
        results[name] = run_planned(plan, cache.clone(), q, k_new, v_new, 0.25).double()
    torch.testing.assert_close(results["policy"], want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(results["minus_one"], want, atol=1e-3, equal_nan=False)


def test_write_kv_skips_negative_slots_byte_exact():
    cache = torch.randn(2, 4, 4, 2, 8)
    cache[:, 0] = float("nan")
    before = cache.clone()
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([5, -1, 9, -1, -1])
    ref_ops.write_kv(cache, k, v, slots)
    flat, old = cache.view(2, -1, 2, 8), before.view(2, -1, 2, 8)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 9], v[2])
    untouched = [s for s in range(16) if s not in (5, 9)]
    assert torch.equal(flat[:, untouched].view(torch.int32), old[:, untouched].view(torch.int32))
