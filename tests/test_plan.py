"""plan_step: layout properties over random batches, and a clear ValueError for every bad input."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fullgraph as fg
from fullgraph.padding import check, get_policy
from fullgraph.plan import SeqChunk, bucket_for

CFG = fg.RunnerConfig(max_num_seqs=8, max_num_tokens=64, max_model_len=200, block_size=16, num_blocks=120)


def random_chunks(rng: np.random.Generator, cfg: fg.RunnerConfig = CFG) -> list[fg.SeqChunk]:
    n = int(rng.integers(1, cfg.max_num_seqs + 1))
    budget = cfg.max_num_tokens
    pool = list(rng.permutation(np.arange(1, cfg.num_blocks)))
    chunks = []
    for i in range(n):
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(1, max(2, budget - (n - i - 1)) // 2 + 1))
        q_len = max(1, min(q_len, budget - (n - i - 1)))
        budget -= q_len
        start = int(rng.integers(0, cfg.max_model_len - q_len + 1))
        need = -(-(start + q_len) // cfg.block_size) + int(rng.integers(0, 2))
        need = min(need, cfg.max_blocks_per_seq)
        blocks = [int(pool.pop()) for _ in range(need)]
        chunks.append(fg.SeqChunk(rng.integers(0, 100, q_len).tolist(), start, blocks, request_id=f"r{i}"))
    return chunks


def naive_layout(chunks, cfg):
    """Per-chunk loop: the obviously-correct version of the planner's vectorised arithmetic."""
    positions, slots, ids, last = [], [], [], []
    for c in chunks:
        for j, tok in enumerate(c.token_ids):
            p = c.start_pos + j
            positions.append(p)
            slots.append(c.block_ids[p // cfg.block_size] * cfg.block_size + p % cfg.block_size)
            ids.append(tok)
        last.append(len(positions) - 1)
    return positions, slots, ids, last


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("pad", [True, False])
def test_random_batches_lay_out_and_pass_check(seed, pad):
    rng = np.random.default_rng(seed)
    chunks = random_chunks(rng)
    policy = get_policy("sdpa")
    plan = fg.plan_step(chunks, CFG, policy, pad=pad)
    if pad:
        check(plan, policy)
    nt, nr = plan.num_tokens, plan.num_reqs
    positions, slots, ids, last = naive_layout(chunks, CFG)
    assert nt == len(positions) and nr == len(chunks)
    np.testing.assert_array_equal(plan.positions[:nt], positions)
    np.testing.assert_array_equal(plan.slot_mapping[:nt], slots)
    np.testing.assert_array_equal(plan.input_ids[:nt], ids)
    np.testing.assert_array_equal(plan.logits_indices[:nr], last)
    np.testing.assert_array_equal(plan.seq_lens[:nr], [c.start_pos + len(c.token_ids) for c in chunks])
    for r, c in enumerate(chunks):
        np.testing.assert_array_equal(plan.block_table[r, : len(c.block_ids)], c.block_ids)
        assert not plan.block_table[r, len(c.block_ids):].any()
    expected_t = bucket_for(nt, CFG.buckets) if pad else nt
    assert plan.num_tokens_padded == expected_t
    assert plan.num_reqs_padded == (min(expected_t, CFG.max_num_seqs) if pad else nr)
    assert len(plan.query_start_loc) == plan.num_reqs_padded + 1
    assert plan.block_table.shape == (plan.num_reqs_padded, CFG.max_blocks_per_seq)
    assert plan.decode_only == all(len(c.token_ids) == 1 for c in chunks)


def test_decode_batches_pad_requests_with_tokens():
    chunks = [fg.SeqChunk([1], 5, [i + 1]) for i in range(3)]
    plan = fg.plan_step(chunks, CFG, get_policy("sdpa"))
    assert plan.key == (4, True) and plan.num_reqs_padded == 4
    np.testing.assert_array_equal(plan.query_start_loc, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(plan.seq_start_loc, [0, 6, 12, 18, 18])
    np.testing.assert_array_equal(plan.slot_mapping, [21, 37, 53, -1])
    np.testing.assert_array_equal(plan.seq_lens, [6, 6, 6, 0])


def test_seq_lens_tail_follows_the_policy():
    policy = fg.PaddingPolicy("tail_one", reads=frozenset({"seq_lens"}), tails={"seq_lens": 1})
    plan = fg.plan_step([fg.SeqChunk([1, 2, 3], 0, [1])], CFG, policy)
    assert plan.num_reqs_padded == 4 and list(plan.seq_lens) == [3, 1, 1, 1]
    check(plan, policy)


def test_default_capture_sizes_include_off_stride_maxima():
    cfg = fg.RunnerConfig(max_num_seqs=12, max_num_tokens=300)
    sizes = cfg.buckets
    assert sizes[:5] == (1, 2, 4, 8, 12) and 256 in sizes and 272 in sizes and 288 in sizes
    assert sizes[-1] == 300 and 264 not in sizes
    big = fg.RunnerConfig(max_num_seqs=64, max_num_tokens=2048).buckets
    assert big[big.index(512):] == (512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048)
    assert fg.RunnerConfig(max_num_seqs=64, max_num_tokens=1000).buckets[-3:] == (768, 896, 1000)
    custom = fg.RunnerConfig(max_num_seqs=6, max_num_tokens=64, capture_sizes=(8, 2, 4))
    assert custom.buckets == (2, 4, 6, 8)


def _chunk(tokens=(1, 2), start=0, blocks=(1,), rid=None):
    return fg.SeqChunk(list(tokens), start, list(blocks), request_id=rid)


BAD_INPUTS = [
    ("empty chunk", [_chunk(), _chunk(tokens=(), blocks=(2,))], "chunk 1", "token_ids"),
    ("negative start", [_chunk(start=-1)], "chunk 0", "start_pos"),
    ("past max_model_len", [_chunk(start=199, blocks=range(1, 14))], "chunk 0", "max_model_len"),
    ("too few blocks", [_chunk(tokens=range(20))], "chunk 0", "block_ids"),
    ("block out of range", [_chunk(blocks=(120,))], "chunk 0", "block_ids"),
    ("null block", [_chunk(), _chunk(blocks=(0,), rid="b")], "chunk 1 (request 'b')", "null block"),
    ("shared block", [_chunk(blocks=(3,)), _chunk(blocks=(3,))], "chunk 1", "block 3 is also used by chunk 0"),
    ("block twice in one chunk", [_chunk(tokens=range(20), blocks=(4, 4))], "chunk 0", "the same chunk"),
    ("too many blocks", [_chunk(blocks=range(1, 15))], "chunk 0", "max_blocks_per_seq"),
    ("too many tokens", [_chunk(tokens=range(65), blocks=range(1, 6))], "65 tokens", "max_num_tokens"),
    ("too many chunks", [_chunk(blocks=(i,)) for i in range(1, 10)], "9 chunks", "max_num_seqs"),
    ("token outside vocab", [_chunk(), _chunk(tokens=(3, 100), blocks=(2,))], "chunk 1", "token id 100"),
    ("negative token", [_chunk(tokens=(-1,))], "chunk 0", "token id -1"),
    ("no chunks", [], "at least one chunk", "chunk"),
]




def _token(token=1, start=0, blocks=(1,), rid=None):
    """A decode chunk: one token (a step of only these takes the decode path)."""
    return fg.SeqChunk([token], start, list(blocks), request_id=rid)


def _many(*chunks):
    """Enough decode chunks before ``chunks`` (blocks 50..) for the vectorised decode layout."""
    return [_token(blocks=(50 + i,)) for i in range(6 - len(chunks))] + list(chunks)


DECODE_BAD_INPUTS = [
    ("decode negative start", [_token(start=-1)], "chunk 0", "start_pos"),
    ("decode past max_model_len", [_token(start=200, blocks=range(1, 14))], "chunk 0", "max_model_len"),
    ("decode too few blocks", [_token(), _token(start=16, blocks=(2,))], "chunk 1", "positions up to 16 need 2"),
    ("decode block out of range", [_token(), _token(blocks=(120,))], "chunk 1", "block id 120"),
    ("decode negative block", [_token(blocks=(-3,))], "chunk 0", "block id -3"),
    ("decode null block", [_token(blocks=(0,), rid="z")], "chunk 0 (request 'z')", "null block"),
    ("decode repeated block", [_token(blocks=(5,)), _token(blocks=(6,)), _token(blocks=(7, 5))], "chunk 2",
     "block 5 is also used by chunk 0"),
    ("decode block twice in one chunk", [_token(start=20, blocks=(4, 4))], "chunk 0", "the same chunk"),
    ("decode too many blocks", [_token(blocks=range(1, 15))], "chunk 0", "max_blocks_per_seq"),
    ("decode too many chunks", [_token(blocks=(i,)) for i in range(1, 10)], "9 chunks", "max_num_seqs"),
    ("decode token outside vocab", [_token(), _token(token=100, blocks=(2,))], "chunk 1", "token id 100"),
    ("decode negative token", [_token(token=-1)], "chunk 0", "token id -1"),
    ("decode many repeated block", _many(_token(blocks=(9, 3)), _token(blocks=(3,))), "chunk 5",
     "block 3 is also used by chunk 4"),
    ("decode many null block", _many(_token(blocks=(0,))), "chunk 5", "null block"),
    ("decode many too few blocks", _many(_token(start=40, blocks=(1, 2))), "chunk 5", "block_ids"),
]


@pytest.mark.parametrize("name,chunks,who,what", BAD_INPUTS + DECODE_BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS + DECODE_BAD_INPUTS])
def test_bad_input_names_the_chunk_and_field(name, chunks, who, what):
    with pytest.raises(ValueError) as err:
        fg.plan_step(chunks, CFG, get_policy("sdpa"), vocab_size=100)
    assert who in str(err.value) and what in str(err.value)


def test_seq_chunk_is_a_frozen_dataclass():
    """``SeqChunk``'s own ``__init__`` (fast to build: a decode step makes one a request) keeps what
    the dataclass gave: keyword and positional fields, the default, equality, ``replace`` and no
    assignment."""
    chunk = SeqChunk([5, 6], 3, [1, 2], "r")
    assert chunk == SeqChunk(token_ids=[5, 6], start_pos=3, block_ids=[1, 2], request_id="r")
    assert SeqChunk([5], 0, [1]).request_id is None
    assert [f.name for f in dataclasses.fields(SeqChunk)] == ["token_ids", "start_pos", "block_ids", "request_id"]
    moved = dataclasses.replace(chunk, start_pos=4)
    assert (moved.start_pos, moved.token_ids, chunk.start_pos) == (4, [5, 6], 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.start_pos = 9
    assert "start_pos=3" in repr(chunk)
