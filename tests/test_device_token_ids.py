"""Token ids handed over on the device (``runner.step(chunks, token_ids=...)``) and the overlapped
greedy loop built on them: the same logits and tokens as host ids, clear errors for bad tensors."""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph.fetch import HostFetch
from fullgraph.generate import greedy
from harness import HAS_CUDA, Mode, assert_logits_close, make_runner, modes_under_test

MODES = modes_under_test() + [Mode("none", "sdpa")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
def test_device_ids_give_the_logits_of_host_ids(mode):
    host, dev = make_runner(mode), make_runner(mode, validate=mode.cudagraph != "none")
    gen = torch.Generator().manual_seed(1)
    pages = [host.blocks.allocate(4) for _ in range(3)]
    assert [dev.blocks.allocate(4) for _ in range(3)] == pages
    lens, pos = [7, 1, 12], [0, 0, 0]
    for step in range(3):  # a mixed prefill step, then two decode steps
        ids = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in lens]
        chunks = [fg.SeqChunk(t, p, b) for t, p, b in zip(ids, pos, pages)]
        blanks = [fg.SeqChunk([3] * len(t), p, b) for t, p, b in zip(ids, pos, pages)]  # lengths only
        flat = torch.tensor(sum(ids, []), device=dev.device, dtype=torch.int64 if step != 1 else torch.int32)
        ref, got = host.step(chunks), dev.step(blanks, token_ids=flat)
        assert_logits_close(ref, got)
        pos = [p + n for p, n in zip(pos, lens)]
        lens = [1, 1, 1]


@pytest.mark.parametrize("mode", modes_under_test(), ids=lambda m: m.id)
def test_step_outputs_as_views_of_the_buffers(mode):
    """``copy_outputs=False``: the logits of the copying twin, as a view of the output buffer that
    the next step overwrites."""
    copying, viewing = make_runner(mode), make_runner(mode, validate=True)
    pages = [copying.blocks.allocate(2) for _ in range(2)]
    assert [viewing.blocks.allocate(2) for _ in range(2)] == pages
    chunks = [fg.SeqChunk([5, 9, 2, 33], 0, pages[0]), fg.SeqChunk([8, 1], 0, pages[1])]
    ref, got = copying.step(chunks), viewing.step(chunks, copy_outputs=False)
    assert_logits_close(ref, got)
    buffer = viewing.buffers.outputs["logits"]
    assert got.logits.data_ptr() == buffer.data_ptr() and got.logits.shape == (2, buffer.shape[1])
    first = got.logits.clone()
    viewing.step([fg.SeqChunk([7], 4, pages[0]), fg.SeqChunk([7], 2, pages[1])])
    assert not torch.equal(got.logits, first)     # the next step wrote over it


def _bad(runner, chunk, token_ids, match):
    with pytest.raises(ValueError, match=match):
        runner.step([chunk], token_ids=token_ids)


def test_bad_token_id_tensors_are_refused_before_the_step():
    runner = make_runner(Mode("padded" if not HAS_CUDA else "full"), validate=True)
    pages = runner.blocks.allocate(2)
    chunk = fg.SeqChunk([1, 2, 3], 0, pages)
    dev = runner.device
    _bad(runner, chunk, torch.tensor([1, 2], device=dev), r"token_ids: expected a \(3,\) int64 or int32 tensor")
    _bad(runner, chunk, torch.tensor([1.0, 2, 3], device=dev), "got torch.float32")
    _bad(runner, chunk, [1, 2, 3], "got list")
    _bad(runner, chunk, torch.tensor([1, 2, 9999], device=dev), r"token_ids\[2\] = 9999: outside the vocabulary")
    assert runner.stats()["steps"] == 0
    ok = runner.step([chunk], token_ids=torch.tensor([1, 2, 3], device=dev))
    assert torch.isfinite(ok.logits).all()


@pytest.mark.skipif(not HAS_CUDA, reason="a CPU runner's device is the host")
@pytest.mark.gpu
def test_host_token_ids_for_a_cuda_runner_are_refused():
    runner = make_runner(Mode("full"))
    _bad(runner, fg.SeqChunk([1], 0, runner.blocks.allocate(1)), torch.tensor([1]), "on cuda")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
def test_overlapped_greedy_gives_the_same_tokens(mode):
    prompts = [[5, 9, 2, 33, 17], list(range(40, 77)), [8]]
    sync = greedy(make_runner(mode), prompts, 9)
    runner = make_runner(mode)
    over = greedy(runner, prompts, 9, overlap=True)
    assert over.tokens == sync.tokens
    assert len(over.decode_seconds) == len(sync.decode_seconds) == 8
    assert over.modes == sync.modes
    assert runner.blocks.num_free == runner.config.num_blocks - 1  # pages freed


def test_host_fetch_reads_each_copy_while_the_next_is_in_flight():
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    fetch = HostFetch({"ids": ((3,), torch.int64), "p": ((3, 2), torch.float32)}, device)
    a = fetch.start({"ids": torch.tensor([1, 2, 3], device=device)})
    b = fetch.start({"ids": torch.tensor([4, 5, 6], device=device), "p": torch.full((2, 2), 0.5, device=device)})
    got_a, got_b = fetch.wait(a), fetch.wait(b, rows=2)
    assert list(got_a) == ["ids"] and got_a["ids"].tolist() == [1, 2, 3]
    assert got_b["ids"].tolist() == [4, 5] and got_b["p"].tolist() == [[0.5, 0.5]] * 2
    c = fetch.start({"ids": torch.tensor([7, 8, 9], device=device)})
    assert c == a and fetch.wait(c)["ids"].tolist() == [7, 8, 9]
    d = fetch.start({"ids": torch.tensor([1], device=device)})     # fewer rows than the room's last copy
    assert d == b and fetch.wait(d)["ids"].tolist() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
def test_host_fetch_copies_what_the_step_stream_wrote_last():
    """The side stream's copy waits for the step's stream: a long kernel then the write of the ids,
    queued before ``start``, arrive whole; the ids' memory freed right after is not reused early."""
    fetch = HostFetch({"ids": ((4096,), torch.int64)}, torch.device("cuda"))
    for step in range(3):
        big = torch.randn(4096, 4096, device="cuda")
        ids = (big @ big).argmax(-1) * 0 + torch.arange(4096, device="cuda") + step   # written late in the stream
        handle = fetch.start({"ids": ids})
        del ids, big
        torch.empty(4096, dtype=torch.int64, device="cuda").fill_(-1)       # would take the ids' memory
        assert fetch.wait(handle)["ids"].tolist() == list(range(step, 4096 + step)), f"step {step}"
