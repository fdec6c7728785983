"""The toy-llama regression suite: SCENARIOS.md 1, 3-11, 13, 14, 16, every mode against eager.

CPU runs ``cudagraph="padded"``; the GPU params (marked ``gpu``) run ``"full"`` and compiled.
Each test drives a ``Twin``: the same chunks through ``"none"`` and the mode under test.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import fullgraph as fg
from harness import Mode, Twin, assert_logits_close, kv_bytes, make_runner

CPU_MODES = [Mode("padded", "sdpa"), Mode("padded", "triton")]
GPU_MODES = [Mode("full", "sdpa"), Mode("full", "triton"), Mode("full", "flash", dtype=torch.bfloat16)]
# Compiled modes run a subset of these scenarios in test_compile.py (each runner compiles anew).
MODES = [pytest.param(m, id=m.id) for m in CPU_MODES] + \
        [pytest.param(m, id=m.id, marks=pytest.mark.gpu) for m in GPU_MODES]


@pytest.fixture(params=MODES)
def mode(request) -> Mode:
    m = request.param
    if m.attention not in fg.attention.backends.available_backends():
        pytest.skip(f"attention backend {m.attention!r} is not available")
    return m


def prompts_only(mode: Mode) -> None:
    """Backends that cannot attend to cached context run only the prompt-only scenarios."""
    if mode.attention == "flash" and not fg.attention.backends.get_backend_class("flash").supports_context():
        pytest.skip("flash: this PyTorch has no paged FlashAttention, so steps with cached context are refused")


def test_s01_bucket_tail_repeats_last_value(mode):
    prompts_only(mode)
    for sizes, bucket in [((4, 8), 4), ((8,), 8)]:
        twin = Twin(mode, capture_sizes=sizes + (16, 128))
        reqs = [twin.new_request(64) for _ in range(3)]
        twin.step([twin.chunk(r, n) for r, n in zip(reqs, (5, 7, 3))])
        ref, got = twin.step([twin.chunk(r, 1) for r in reqs])
        assert got.num_tokens_padded == bucket
        assert_logits_close(ref, got, mode.dtype)
        qsl = twin.test.buffers.tensors["query_start_loc"][: min(bucket, 8) + 1].cpu()
        assert qsl[3:].tolist() == [3] * (len(qsl) - 3)


def test_s03_padded_token_rows_leave_last_token_exact(mode):
    twin = Twin(mode)
    for n in (1, 3, 13, 17, 31, 100):
        ref, got = twin.step([twin.chunk(twin.new_request(128), n)])
        assert got.num_tokens_padded >= n
        assert_logits_close(ref, got, mode.dtype)


def poison(runner: fg.FullGraphRunner) -> None:
    """NaN in the output buffer, the null block and every unallocated page; garbage past the
    planned sizes of the integer buffers (copy_in rewrites only the live prefix and padded tail)."""
    runner.buffers.logits.fill_(float("nan"))
    unused = [b for b in range(runner.config.num_blocks) if not runner.blocks.is_allocated(b)]
    for cache in runner.kv_caches:
        cache[:, unused] = float("nan")
    for name, buf in runner.buffers.tensors.items():
        buf.fill_(-(2**30) if name != "block_table" else 2**30)


def test_s04_poisoned_buffers_do_not_reach_real_logits(mode):
    prompts_only(mode)
    twin = Twin(mode)
    a, b = twin.new_request(100), twin.new_request(100)
    twin.step([twin.chunk(a, 9), twin.chunk(b, 20)])
    for step in range(3):
        poison(twin.test)
        chunks = [twin.chunk(a, 1), twin.chunk(b, 5 if step == 1 else 1)]
        ref, got = twin.step(chunks)
        assert_logits_close(ref, got, mode.dtype)


def test_s05_kv_canary_only_real_slots_change(mode):
    prompts_only(mode)
    twin = Twin(mode, validate=False)  # strict mode resets the null block; this test checks it stays
    runner = twin.test
    for cache in runner.kv_caches:  # random bytes everywhere: any stray write shows
        cache.copy_(torch.randn_like(cache))
    before = kv_bytes(runner)
    reqs = [twin.new_request(64) for _ in range(3)]
    real: set[int] = set()
    # 16: a prompt ending exactly on a page; then a mixed step and a decode step, all padded.
    for lens in [(16, 5, 31), (1, 3, 1), (1, 1, 1)]:
        chunks = [twin.chunk(r, n) for r, n in zip(reqs, lens)]
        plan = fg.plan_step(chunks, runner.config, runner.policy)
        assert plan.num_tokens_padded > plan.num_tokens
        real |= set(plan.slot_mapping[: plan.num_tokens].tolist())
        twin.step(chunks)
    num_slots = runner.config.num_blocks * runner.config.block_size
    for old, new in zip(before, kv_bytes(runner)):
        changed = (old != new).reshape(2, num_slots, -1).any(-1).any(0)  # (num_slots,)
        assert set(torch.nonzero(changed).flatten().tolist()) <= real
        assert torch.equal(old[:, 0], new[:, 0]), "the null block was written"
        assert torch.equal(old[:, -1, -1], new[:, -1, -1]), "the last slot of the last block was written"


def test_s06_shrinking_batch_points_padding_at_null_block(mode):
    prompts_only(mode)
    twin = Twin(mode)
    reqs = [twin.new_request(48) for _ in range(8)]
    twin.step([twin.chunk(r, 4 + i) for i, r in enumerate(reqs)])
    ref, got = twin.step([twin.chunk(r, 1) for r in reqs])
    assert_logits_close(ref, got, mode.dtype)
    ref, got = twin.step([twin.chunk(r, 1) for r in reqs[5:]])
    assert_logits_close(ref, got, mode.dtype)
    table = twin.test.buffers.tensors["block_table"][: got.num_tokens_padded].cpu()
    assert got.num_tokens_padded == 4 and not table[3:].any()


def test_s07_same_bucket_different_contents(mode):
    prompts_only(mode)
    twin = Twin(mode)
    group_a = [twin.new_request(64) for _ in range(3)]
    group_b = [twin.new_request(200) for _ in range(3)]
    twin.step([twin.chunk(r, n) for r, n in zip(group_a, (3, 9, 30))])
    twin.step([twin.chunk(r, n) for r, n in zip(group_b, (60, 20, 40))])
    for group in (group_a, group_b, group_a, group_b):
        ref, got = twin.step([twin.chunk(r, 1) for r in group])
        assert got.num_tokens_padded == 4
        assert_logits_close(ref, got, mode.dtype)


def test_s08_context_growth_across_page_boundaries(mode):
    prompts_only(mode)
    twin = Twin(mode)
    a, b = twin.new_request(256), twin.new_request(256)
    twin.step([twin.chunk(a, 14), twin.chunk(b, 30)])
    for _ in range(5):  # a: 15 -> 19, b: 31 -> 35 (crossing 16 and 32)
        ref, got = twin.step([twin.chunk(a, 1), twin.chunk(b, 1)])
        assert_logits_close(ref, got, mode.dtype)
    twin.step([twin.chunk(b, 100), twin.chunk(a, 1)])  # 101 tokens: fits max_num_tokens 128
    for _ in range(3):  # longer contexts, across any kernel threshold on the way
        ref, got = twin.step([twin.chunk(a, 1), twin.chunk(b, 1)])
        assert_logits_close(ref, got, mode.dtype)


def test_s09_replay_near_max_model_len(mode):
    prompts_only(mode)
    twin = Twin(mode)
    req = twin.new_request(256)
    for n in (120, 120, 10):
        ref, got = twin.step([twin.chunk(req, n)])
        assert_logits_close(ref, got, mode.dtype)
    while req.pos < 256:
        ref, got = twin.step([twin.chunk(req, 1)])
        assert_logits_close(ref, got, mode.dtype)


def test_s10_mixed_chunked_one_token_prefill_page_boundary(mode):
    prompts_only(mode)
    twin = Twin(mode)
    a, b, c, d = (twin.new_request(128) for _ in range(4))
    twin.step([twin.chunk(a, 20), twin.chunk(b, 16)])
    # decode a, continue b's prefill with cached context ending exactly on a page (16 + 16 = 32),
    # a one-token prefill c, and a fresh 7-token prompt d: one mixed step.
    ref, got = twin.step([twin.chunk(a, 1), twin.chunk(b, 16), twin.chunk(c, 1), twin.chunk(d, 7)])
    assert_logits_close(ref, got, mode.dtype)
    ref, got = twin.step([twin.chunk(r, 1) for r in (a, b, c, d)])
    assert_logits_close(ref, got, mode.dtype)


def test_s11_off_stride_sizes_and_fallback(mode, caplog):
    twin = Twin(mode, max_num_seqs=6, capture_sizes=(1, 2, 4, 8, 16, 32))
    reqs = [twin.new_request(64) for _ in range(6)]
    ref, got = twin.step([twin.chunk(reqs[0], 17)])
    assert got.num_tokens_padded == 32
    assert_logits_close(ref, got, mode.dtype)
    if mode.attention != "flash":
        ref, got = twin.step([twin.chunk(r, 1) for r in reqs])  # max_num_seqs = 6: its own bucket
        assert got.num_tokens_padded == 6
        assert_logits_close(ref, got, mode.dtype)
    with caplog.at_level(logging.WARNING, logger="fullgraph"):
        for n in (32, 33, 40):  # the largest size, then above it twice: padded-eager, logged once
            ref, got = twin.step([twin.chunk(twin.new_request(64), n)])
            assert_logits_close(ref, got, mode.dtype)
    assert got.num_tokens_padded == 40 and got.mode == "padded"
    if mode.cudagraph == "full":
        assert sum(twin.test.stats()["eager_fallbacks"].values()) == 2
        assert sum("above the largest captured size" in r.message for r in caplog.records) == 2


def test_s13_neighbours_do_not_change_a_request(mode):
    prompts_only(mode)
    outs = []
    for seed in (1, 2):
        twin = Twin(mode)
        rng = np.random.default_rng(seed)
        reqs = [twin.new_request(64) for _ in range(3)]
        chunks = [twin.chunk(reqs[0], 10, list(range(10)))]
        chunks += [twin.chunk(r, 6, rng.integers(0, 512, 6).tolist()) for r in reqs[1:]]
        _, got = twin.step(chunks)
        decode = [twin.chunk(reqs[0], 1, [7])] + [twin.chunk(r, 1, [int(rng.integers(512))]) for r in reqs[1:]]
        _, got2 = twin.step(decode)
        outs.append((got.logits[0], got2.logits[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_s14_returned_logits_survive_the_next_step(mode):
    prompts_only(mode)
    twin = Twin(mode)
    a = twin.new_request(64)
    _, first = twin.step([twin.chunk(a, 5)])
    kept = first.logits.clone()
    for _ in range(2):
        twin.step([twin.chunk(a, 1)])
    assert torch.equal(first.logits, kept)


BAD = {  # case -> (chunks from (request, a valid chunk), what the message must name)
    "empty chunk": (lambda r, ok: [ok, fg.SeqChunk([], 0, [5])], "chunk 1: token_ids"),
    "position past max_model_len": (lambda r, ok: [fg.SeqChunk([1], 256, r.blocks)], "chunk 0: start_pos"),
    "too few blocks": (lambda r, ok: [fg.SeqChunk(list(range(40)), 0, r.blocks[:2])], "chunk 0: block_ids"),
    "block out of range": (lambda r, ok: [ok, fg.SeqChunk([1], 0, [10**6])], "chunk 1: block_ids"),
    "null block": (lambda r, ok: [ok, fg.SeqChunk([1], 0, [0])], "chunk 1: block_ids"),
    "block in two requests": (lambda r, ok: [ok, fg.SeqChunk([1], 0, [r.blocks[0]])], "chunk 1: block_ids"),
    "too many tokens": (lambda r, ok: [fg.SeqChunk(list(range(129)), 0, r.blocks)], "max_num_tokens"),
    "too many requests": (lambda r, ok: [fg.SeqChunk([1], 0, [100 + i]) for i in range(9)], "max_num_seqs"),
    "token outside vocabulary": (lambda r, ok: [ok, fg.SeqChunk([512], 0, [100])], "chunk 1: token_ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_s16_bad_input_leaves_state_untouched(mode, case):
    prompts_only(mode)
    twin = Twin(mode)
    r = twin.new_request(256)
    twin.step([twin.chunk(r, 12)])
    runner = twin.test
    before, free = kv_bytes(runner), runner.blocks.num_free
    make, expected = BAD[case]
    with pytest.raises(ValueError, match=expected):
        runner.step(make(r, fg.SeqChunk([3], r.pos, r.blocks)))
    assert all(torch.equal(x, y) for x, y in zip(before, kv_bytes(runner))) and runner.blocks.num_free == free
    ref, got = twin.step([twin.chunk(r, 1)])
    assert_logits_close(ref, got, mode.dtype)


@pytest.mark.gpu
def test_bf16_greedy_tokens_identical_over_32_steps():
    """Acceptance: 8 mixed requests, bf16, full graphs vs eager, greedy for 32 steps."""
    for attention in [b for b in ("sdpa", "triton") if b in fg.attention.backends.available_backends()]:
        twin = Twin(Mode("full", attention, dtype=torch.bfloat16))
        reqs = [twin.new_request(200) for _ in range(8)]
        ref, got = twin.step([twin.chunk(r, 3 + 3 * i) for i, r in enumerate(reqs)])  # 108 tokens
        for _ in range(32):
            ids_ref, ids_got = ref.logits.argmax(-1).tolist(), got.logits.argmax(-1).tolist()
            assert ids_ref == ids_got, f"{attention}: greedy tokens differ: {ids_ref} vs {ids_got}"
            ref, got = twin.step([twin.chunk(r, 1, [t]) for r, t in zip(reqs, ids_ref)])


@pytest.mark.gpu
def test_s12_moved_buffer_is_detected():
    runner = make_runner(Mode("full", "sdpa"), validate=True)
    ids = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk([1, 2, 3], 0, ids)])
    runner.kv_caches[0] = runner.kv_caches[0].clone()
    with pytest.raises(fg.graphs.AddressMovedError, match="kv_caches"):
        runner.step([fg.SeqChunk([4], 3, ids)])
