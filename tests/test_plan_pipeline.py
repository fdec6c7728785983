"""The planning pipeline's stages: read_chunks checks everything before layout writes anything, the
decode variant of each stage gives what the general one gives, and the block-id cache changes no
stage's result."""
from __future__ import annotations

import numpy as np
import pytest

import fullgraph as fg
from fullgraph.block_ids import BlockIdCache
from fullgraph.chunks import FEW, read_chunks
from fullgraph.padding import get_policy
from fullgraph.plan import Target, layout, padded_sizes, plan_with_cache
from test_host_path import BIG, TAIL_ONE, assert_same_plan, decode_chunks, garbage_arrays
from test_plan import CFG, random_chunks

SIZES = [1, FEW - 1, FEW, FEW + 1, 40]  # both sides of the few-chunk paths


def _lay_out(inputs, policy, cfg=BIG):
    t_pad, r_pad = padded_sizes(len(inputs.tokens), len(inputs.starts), cfg, True)
    return layout(inputs, cfg, Target(policy.table, policy, None, None), t_pad, r_pad, cfg.num_blocks)


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cached"])
@pytest.mark.parametrize("policy", [get_policy("sdpa"), TAIL_ONE], ids=["sdpa", "tail_one"])
@pytest.mark.parametrize("n", SIZES)
def test_the_decode_variant_lays_out_as_the_general_layout(n, policy, cached):
    chunks = decode_chunks(np.random.default_rng(n), n)
    cache = BlockIdCache() if cached else None
    if cached:
        read_chunks(chunks, BIG, BIG.num_blocks, 100, cache)  # every list known: rows come ready
    inputs = read_chunks(chunks, BIG, BIG.num_blocks, 100, cache)
    assert inputs.q_lens is None and (inputs.table is not None) == cached
    general = inputs._replace(q_lens=np.ones(n, np.int64), table=None)
    got, want = _lay_out(inputs, policy), _lay_out(general, policy)
    assert got.decode_only and not want.decode_only
    for name in got.arrays:
        np.testing.assert_array_equal(got.arrays[name], want.arrays[name], err_msg=name)
    assert (got.num_tokens_padded, got.num_reqs_padded, got.max_query_len, got.max_seq_len) == \
        (want.num_tokens_padded, want.num_reqs_padded, want.max_query_len, want.max_seq_len)


@pytest.mark.parametrize("n", SIZES)
def test_a_cached_read_is_the_plain_read(n):
    chunks = decode_chunks(np.random.default_rng(100 + n), n)
    cache = BlockIdCache()
    plain = read_chunks(chunks, BIG, BIG.num_blocks, 100)
    for _ in range(2):  # the first read fills the cache, the second reads from it
        cached = read_chunks(chunks, BIG, BIG.num_blocks, 100, cache)
        for name in ("starts", "ends", "tokens", "blocks", "n_blocks"):
            np.testing.assert_array_equal(getattr(cached, name), getattr(plain, name), err_msg=name)
        assert cached.max_seq_len == plain.max_seq_len and plain.table is None
    np.testing.assert_array_equal(cached.table, _lay_out(plain, get_policy("sdpa")).block_table[:n])


@pytest.mark.parametrize("seed", range(6))
def test_the_pipeline_is_plan_with_cache(seed):
    chunks = random_chunks(np.random.default_rng(seed))
    policy = get_policy("sdpa")
    inputs = read_chunks(chunks, CFG, CFG.num_blocks, None)
    assert (inputs.q_lens is None) == all(len(c.token_ids) == 1 for c in chunks)
    want = plan_with_cache(chunks, CFG, Target(policy.table, policy, None, None), True, None, None, None)
    assert_same_plan(_lay_out(inputs, policy, CFG), want)


@pytest.mark.parametrize("n", SIZES)
def test_a_decode_token_on_the_last_given_page_fits_and_one_past_it_does_not(n):
    bs = BIG.block_size
    chunks = [fg.SeqChunk([1], 0, [1 + 2 * i, 2 + 2 * i]) for i in range(n)]
    edge = chunks[:-1] + [fg.SeqChunk([1], 2 * bs - 1, chunks[-1].block_ids)]
    assert read_chunks(edge, BIG, BIG.num_blocks, None).max_seq_len == 2 * bs
    past = chunks[:-1] + [fg.SeqChunk([1], 2 * bs, chunks[-1].block_ids, request_id="last")]
    with pytest.raises(ValueError, match=f"chunk {n - 1} \\(request 'last'\\): block_ids: 2 blocks cover {2 * bs} "
                                         f"positions; positions up to {2 * bs} need 3"):
        read_chunks(past, BIG, BIG.num_blocks, None)


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cached"])
@pytest.mark.parametrize("n", SIZES)
def test_a_refused_step_writes_nothing(n, cached):
    chunks = decode_chunks(np.random.default_rng(n), n)
    policy = get_policy("sdpa")
    cache = BlockIdCache() if cached else None
    out = garbage_arrays(BIG)
    target = Target(policy.table, policy, None, out)
    plan_with_cache(chunks, BIG, target, True, None, 100, cache)
    out = garbage_arrays(BIG)
    bad = chunks[:-1] + [fg.SeqChunk([100], chunks[-1].start_pos, chunks[-1].block_ids)]  # outside the vocabulary
    with pytest.raises(ValueError, match=f"chunk {n - 1}: token_ids: token id 100 outside the vocabulary"):
        plan_with_cache(bad, BIG, target._replace(out=out), True, None, 100, cache)
    assert all((arr == -7).all() for arr in out.values())
    assert_same_plan(plan_with_cache(chunks, BIG, target, True, None, 100, cache),
                     fg.plan_step(chunks, BIG, policy, vocab_size=100))
