"""The per-step host path: planning straight into a staging area, the decode layout, large batches
(the bulk conversion and the duplicate check), a runner's block-id cache, and a backend's refusal
before anything runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.block_ids import BlockIdCache
from fullgraph.padding import check, get_policy
from fullgraph.plan import Target, array_shapes, plan_with_cache
from harness import toy_model
from test_plan import CFG, naive_layout, random_chunks

# 64 decode chunks of up to 64 pages: thousands of block ids in one step
BIG = fg.RunnerConfig(max_num_seqs=64, max_num_tokens=256, max_model_len=1024, block_size=16, num_blocks=64 * 64 + 1)
TAIL_ONE = fg.PaddingPolicy("tail_one_host_path", reads=frozenset({"seq_lens"}), tails={"seq_lens": 1, "input_ids": 3})


def decode_chunks(rng: np.random.Generator, n: int, cfg: fg.RunnerConfig = BIG) -> list[fg.SeqChunk]:
    pool = list(rng.permutation(np.arange(1, cfg.num_blocks)))
    chunks = []
    for i in range(n):
        start = int(rng.integers(0, cfg.max_model_len))
        need = min(start // cfg.block_size + 1 + int(rng.integers(0, 3)), cfg.max_blocks_per_seq)
        chunks.append(fg.SeqChunk([int(rng.integers(0, 100))], start, [int(pool.pop()) for _ in range(need)]))
    return chunks


def garbage_arrays(cfg: fg.RunnerConfig) -> dict[str, np.ndarray]:
    shapes = array_shapes(cfg.max_num_tokens, cfg.max_num_seqs, cfg.max_blocks_per_seq)
    return {name: np.full(shape, -7, dtype) for name, (shape, dtype) in shapes.items()}


def assert_same_plan(got: fg.StepPlan, want: fg.StepPlan) -> None:
    for name in array_shapes(1, 1, 1):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert (got.key, got.num_reqs, got.num_reqs_padded, got.max_query_len, got.max_seq_len) == \
        (want.key, want.num_reqs, want.num_reqs_padded, want.max_query_len, want.max_seq_len)


@pytest.mark.parametrize("seed", range(12))
def test_planning_into_staging_arrays_writes_the_whole_padded_plan(seed):
    rng = np.random.default_rng(seed)
    chunks = random_chunks(rng) if seed % 2 else decode_chunks(rng, int(rng.integers(1, 9)), CFG)
    policy = get_policy("sdpa")
    out = garbage_arrays(CFG)
    got = fg.plan_step(chunks, CFG, policy, out=out)
    assert_same_plan(got, fg.plan_step(chunks, CFG, policy))
    assert all(np.shares_memory(getattr(got, name), out[name]) for name in out)


@pytest.mark.parametrize("n", [1, 4, 5])
def test_decode_token_ids_outside_the_vocabulary_are_refused(n):
    """A few decode tokens are range-checked as Python ints, more as one array reduction: both refuse
    an id below 0 or at the vocabulary size, naming the chunk, and take numpy integers."""
    for bad, chunk in ((-1, 0), (100, n - 1)):
        tokens = [np.int64(7)] * n
        tokens[chunk] = bad
        chunks = [fg.SeqChunk([t], 3, [i + 1]) for i, t in enumerate(tokens)]
        with pytest.raises(ValueError, match=f"chunk {chunk}: token_ids: token id {bad} outside the vocabulary"):
            fg.plan_step(chunks, BIG, get_policy("sdpa"), vocab_size=100)
    fg.plan_step([fg.SeqChunk([99], 3, [i + 1]) for i in range(n)], BIG, get_policy("sdpa"), vocab_size=100)


@pytest.mark.parametrize("policy", [get_policy("sdpa"), TAIL_ONE], ids=["sdpa", "tail_one"])
@pytest.mark.parametrize("n", [1, 5, 32, 64])
def test_decode_batches_lay_out_like_the_naive_loop(n, policy):
    chunks = decode_chunks(np.random.default_rng(n), n)
    plan = fg.plan_step(chunks, BIG, policy, vocab_size=100)
    check(plan, policy)
    positions, slots, ids, last = naive_layout(chunks, BIG)
    assert plan.decode_only and plan.max_query_len == 1
    assert plan.max_seq_len == max(c.start_pos for c in chunks) + 1
    np.testing.assert_array_equal(plan.positions[:n], positions)
    np.testing.assert_array_equal(plan.slot_mapping[:n], slots)
    np.testing.assert_array_equal(plan.input_ids[:n], ids)
    np.testing.assert_array_equal(plan.logits_indices[:n], last)
    np.testing.assert_array_equal(plan.query_start_loc[: n + 1], np.arange(n + 1))
    np.testing.assert_array_equal(plan.seq_lens[:n], [c.start_pos + 1 for c in chunks])
    for r, c in enumerate(chunks):
        np.testing.assert_array_equal(plan.block_table[r, : len(c.block_ids)], c.block_ids)
        assert not plan.block_table[r, len(c.block_ids):].any()


@pytest.mark.parametrize("n", [1, 64])  # a few and thousands of block ids
def test_ids_as_numpy_arrays_or_tuples_plan_as_lists_do(n):
    chunks = decode_chunks(np.random.default_rng(1), n)
    policy = get_policy("sdpa")
    want = fg.plan_step(chunks, BIG, policy)
    for convert in (np.asarray, tuple, lambda ids: np.asarray(ids, np.int32)):
        other = [fg.SeqChunk(convert(c.token_ids), c.start_pos, convert(c.block_ids)) for c in chunks]
        assert_same_plan(fg.plan_step(other, BIG, policy), want)


def test_bad_ids_in_a_large_batch_name_the_chunk():
    chunks = decode_chunks(np.random.default_rng(2), 64)
    policy = get_policy("sdpa")
    shared = chunks[3].block_ids[-1]
    dup = chunks[:60] + [fg.SeqChunk([1], 0, [shared], request_id="late")] + chunks[61:]
    with pytest.raises(ValueError, match=f"chunk 60 \\(request 'late'\\): block_ids: block {shared} is also used by chunk 3"):
        fg.plan_step(dup, BIG, policy)
    out_of_range = chunks[:-1] + [fg.SeqChunk([1], 0, [BIG.num_blocks])]
    with pytest.raises(ValueError, match=f"chunk 63: block_ids: block id {BIG.num_blocks} is the null block"):
        fg.plan_step(out_of_range, BIG, policy)


def test_runner_plans_straight_into_its_buffers():
    runner = fg.FullGraphRunner(toy_model(), max_num_seqs=8, max_num_tokens=64, max_model_len=256,
                                cudagraph="padded", attention="sdpa")
    a, b = runner.blocks.allocate(3), runner.blocks.allocate(2)
    runner.step([fg.SeqChunk(list(range(20)), 0, a), fg.SeqChunk([4, 5, 6], 0, b)])
    chunks = [fg.SeqChunk([7], 20, a), fg.SeqChunk([8], 3, b)]
    runner.step(chunks)
    want = fg.plan_step(chunks, runner.config, runner.policy)
    for name, buf in runner.buffers.tensors.items():
        planned = getattr(want, name)
        np.testing.assert_array_equal(buf[: len(planned)].cpu().numpy(), planned, err_msg=name)


class RefuseDecodeBackend(SdpaBackend):
    """sdpa that refuses decode steps (as FlashAttention without paging refuses cached context)."""

    name = "refuse_decode"
    policy = fg.PaddingPolicy("refuse_decode", reads=SdpaBackend.policy.reads)

    def prepare(self, plan) -> str | None:
        return "no decode steps here" if plan.decode_only else None


def test_a_refused_step_changes_nothing_and_the_next_one_runs():
    runner = fg.FullGraphRunner(toy_model(), max_num_seqs=4, max_num_tokens=64, max_model_len=128,
                                cudagraph="padded", attention=RefuseDecodeBackend)
    ids = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk([1, 2, 3], 0, ids)])
    kv = [c.clone() for c in runner.kv_caches]
    stats = runner.stats()
    with pytest.raises(ValueError, match="'refuse_decode' cannot run this step: no decode steps here"):
        runner.step([fg.SeqChunk([4], 3, ids)])
    assert runner.stats() == stats and all(torch.equal(x, y) for x, y in zip(kv, runner.kv_caches))
    out = runner.step([fg.SeqChunk([4, 5], 3, ids)])
    assert out.num_tokens == 2 and torch.isfinite(out.logits).all()


def _plan_cached(chunks, cache, cfg=BIG, num_blocks=None):
    policy = get_policy("sdpa")
    return plan_with_cache(chunks, cfg, Target(policy.table, policy, None, None), True, num_blocks or cfg.num_blocks,
                           100, cache)


def _error(fn) -> str:
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


@pytest.mark.parametrize("seed", range(6))
def test_a_runners_block_id_cache_plans_as_plan_step_does(seed):
    """Decode steps that advance, grow a list in place, swap a list for an equal new one, reorder,
    drop and add requests: the cached plan is plan_step's, every step."""
    rng = np.random.default_rng(seed)
    chunks = decode_chunks(rng, int(rng.integers(1, 12)))
    lists = [list(c.block_ids) for c in chunks]
    free = sorted(set(range(1, BIG.num_blocks)) - {b for ids in lists for b in ids})
    starts = [c.start_pos for c in chunks]
    cache = BlockIdCache()
    for step in range(40):
        action = rng.integers(0, 6)
        i = int(rng.integers(0, len(lists)))
        if action == 0 and len(lists[i]) < BIG.max_blocks_per_seq:
            lists[i].append(free.pop())  # in place: the cached copy must not match any more
        elif action == 1:
            lists[i] = list(lists[i])  # a new list, equal to the cached one
        elif action == 2:
            order = rng.permutation(len(lists))
            lists, starts = [lists[k] for k in order], [starts[k] for k in order]
        elif action == 3 and len(lists) > 1:
            free += lists.pop(i)
            starts.pop(i)
        elif action == 4 and len(lists) < BIG.max_num_seqs:
            lists.append([free.pop()])
            starts.append(0)
        starts = [min(s + 1, len(ids) * BIG.block_size - 1) for s, ids in zip(starts, lists)]
        step_chunks = [fg.SeqChunk([step % 100], s, ids) for s, ids in zip(starts, lists)]
        assert_same_plan(_plan_cached(step_chunks, cache), fg.plan_step(step_chunks, BIG, get_policy("sdpa")))


def test_a_runners_block_id_cache_checks_what_changed_in_full():
    a, b = [1, 2, 3], [4, 5]
    cache = BlockIdCache()
    valid = [fg.SeqChunk([1], 40, a), fg.SeqChunk([2], 20, b)]  # the lists themselves: changes show
    invalid = {  # name: (a change in place, the step), each after the valid step was planned
        "same list twice": (lambda: None, [valid[0], fg.SeqChunk([2], 40, a)]),
        "an equal copy beside it": (lambda: None, [valid[0], fg.SeqChunk([2], 40, list(a))]),
        "a shared id added in place": (lambda: b.append(3), valid),
        "the null block in place": (lambda: a.__setitem__(0, 0), valid[:1]),
        "an id out of range in place": (lambda: a.__setitem__(0, BIG.num_blocks), valid[:1]),
        "too many ids in place": (lambda: a.extend(range(100, 100 + BIG.max_blocks_per_seq)), valid[:1]),
        # lists that only grew: just the appended ids are checked, against the last valid step's
        "an id of another list appended": (lambda: a.append(5), valid),
        "the same new id appended to both": (lambda: (a.append(50), b.append(50)), valid),
        "a new id appended twice": (lambda: a.extend([60, 60]), valid),
        "the null block appended": (lambda: a.append(0), valid),
        "an id out of range appended": (lambda: b.append(BIG.num_blocks), valid),
        "a grown list beside a changed one": (lambda: (a.append(70), b.__setitem__(0, 1)), valid),
    }
    for name, (change, chunks) in invalid.items():
        a[:], b[:] = [1, 2, 3], [4, 5]
        _plan_cached(valid, cache)  # every list known and checked
        change()
        want = _error(lambda: fg.plan_step(chunks, BIG, get_policy("sdpa"), vocab_size=100))
        assert _error(lambda: _plan_cached(chunks, cache)) == want, name
    a[:], b[:] = [1, 2, 3], [4, 5]
    _plan_cached(valid, cache)
    # every list known, but checked against more blocks than this step allows
    small = BIG.replace(num_blocks=4)
    want = _error(lambda: fg.plan_step(valid, small, get_policy("sdpa")))
    assert "block id 4" in want and _error(lambda: _plan_cached(valid, cache, small, 4)) == want
    # a failed step leaves the cache sound: the valid step and a part of it still plan as plan_step does
    for chunks in (valid, valid[1:]):
        assert_same_plan(_plan_cached(chunks, cache), fg.plan_step(chunks, BIG, get_policy("sdpa")))
    # grown lists that pass, step after step (the appended ids join the last step's), then one that
    # names an id appended two steps before
    a[:], b[:] = [1, 2, 3], [4, 5]
    _plan_cached(valid, cache)
    for new_a, new_b in ((80, None), (None, 81), (82, 83)):
        a.extend([new_a] if new_a else []), b.extend([new_b] if new_b else [])
        assert_same_plan(_plan_cached(valid, cache), fg.plan_step(valid, BIG, get_policy("sdpa")))
    b.append(80)
    assert _error(lambda: _plan_cached(valid, cache)) == _error(lambda: fg.plan_step(valid, BIG, get_policy("sdpa")))
    a[:], b[:] = [1, 2, 3], [4, 5]
    wide = BIG.replace(max_model_len=2 * BIG.max_model_len)  # longer block-table rows than those kept
    assert_same_plan(_plan_cached(valid, cache, wide), fg.plan_step(valid, wide, get_policy("sdpa")))
