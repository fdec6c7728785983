"""The stage-in kernel (``kernels.stage_in``): the staged words copied exactly but for the range the
area's two control words name, which stays as it was on the device; under the Triton interpreter
on the CPU, and on the GPU from pinned host memory, launched alone and captured in a CUDA graph
(each replay reads the bytes and the range the host wrote since, never the capture's); and the
runner's step waiting for the previous step's in-graph copy before it rewrites the staging area."""
import pytest
import torch

import fullgraph as fg
from fullgraph import env
from fullgraph.kernels.stage_in import CONTROL, stage_in
from harness import Mode, assert_logits_close, make_runner

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _area(n_words: int, g: torch.Generator, skip: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random staged words ending in the control words ``skip`` (host; pinned on a GPU machine) and
    a device area of other garbage."""
    src = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g)
    src[-CONTROL:] = torch.tensor(skip)
    dst = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g).to(DEVICE)
    return (src.pin_memory() if CUDA else src), dst


def _want(src: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    lo, hi = src[-2].item(), src[-1].item()
    want = src.clone()
    want[lo:hi] = before[lo:hi]
    return want


@pytest.mark.parametrize("n_words,block", [(2, 1024), (37, 16), (1024 * 3 + 5, 1024)])
def test_stage_in_copies_every_word(n_words, block):
    src, dst = _area(n_words, torch.Generator().manual_seed(n_words))
    stage_in(src, dst, block=block)
    assert torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("skip,block", [((6, 7), 1024), ((6, 6 + 2 * 21), 8), ((100, 700), 64), ((0, 1064), 64)])
def test_stage_in_leaves_the_skipped_words(skip, block):
    """The words ``[lo, hi)`` keep what the device held (ids written there before the copy), whatever
    program boundaries the range crosses; every other word, the control words included, is copied."""
    src, dst = _area(2 * 512 + 42, torch.Generator().manual_seed(skip[1]), skip)
    before = dst.cpu()
    stage_in(src, dst, block=block)
    assert torch.equal(dst.cpu(), _want(src, before))


def test_stage_in_refuses_mismatched_areas():
    src, dst = _area(16, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="one size"):
        stage_in(src[:8], dst)
    with pytest.raises(ValueError, match="control words"):
        stage_in(src[:1], dst[:1])
    with pytest.raises(ValueError, match="int32"):
        stage_in(src.view(torch.float32), dst)


def test_stage_event_switch_is_validated(monkeypatch):
    try:
        for value in ("inline", "branch"):
            monkeypatch.setenv(env.STAGE_EVENT, value)
            env.stage_event.cache_clear()
            assert env.stage_event() == value
        monkeypatch.setenv(env.STAGE_EVENT, "later")
        env.stage_event.cache_clear()
        with pytest.raises(ValueError, match="FULLGRAPH_STAGE_EVENT"):
            env.stage_event()
    finally:
        monkeypatch.delenv(env.STAGE_EVENT)
        env.stage_event.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
@pytest.mark.parametrize("captured", [False, True], ids=["launched", "captured"])
def test_stage_in_reads_each_steps_host_bytes(captured):
    """Pinned host words and the skipped range rewritten between launches (or replays of one
    captured launch): each copy sees the new ones (the host reads bypass the GPU's caches; a
    graph reads the area's address, not the capture's bytes)."""
    g = torch.Generator().manual_seed(3)
    src, dst = _area(20_000, g)
    graph = None
    if captured:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stage_in(src, dst)
    for step in range(4):
        lo = int(torch.randint(0, 19_000, (1,), generator=g))
        skip = (lo, lo + 2 * 33) if step % 2 else (0, 0)
        src.copy_(torch.randint(-2**31, 2**31 - 1, (20_000,), dtype=torch.int32, generator=g))
        src[-CONTROL:] = torch.tensor(skip)
        dst.copy_(torch.randint(-2**31, 2**31 - 1, (20_000,), dtype=torch.int32, generator=g))
        before = dst.cpu()
        graph.replay() if captured else stage_in(src, dst)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), _want(src, before)), f"step {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
@pytest.mark.parametrize("where", ["inline", "branch"])
def test_step_waits_for_the_previous_graphs_stage_in(where, monkeypatch):
    """A captured step queued behind a long kernel has not read its staging area yet when the next
    step is planned: the next step must wait for that copy (the event recorded in the graph, in
    line or on a branch: ``FULLGRAPH_STAGE_EVENT``) and not plan over the area, so each step
    computes its own chunks' logits."""
    monkeypatch.setattr(env, "stage_event", lambda: where)
    ref, runner = make_runner(Mode("none", "sdpa")), make_runner(Mode("full"))
    assert (runner.buffers._branch is not None) == (where == "branch")
    pages = [ref.blocks.allocate(4) for _ in range(3)]
    assert [runner.blocks.allocate(4) for _ in range(3)] == pages
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (9, 4, 13)]
    steps = [[fg.SeqChunk(p, 0, b) for p, b in zip(prompts, pages)]]
    for k in range(3):   # decode steps of different ids and positions
        steps.append([fg.SeqChunk([int(torch.randint(1, 500, (1,), generator=g))], len(p) + k, b)
                      for p, b in zip(prompts, pages)])
    runner.step(steps[0])
    torch.cuda.synchronize()
    outs = []
    for chunks in steps[1:]:
        torch.cuda._sleep(50_000_000)   # tens of ms on the step's stream: the graph waits behind it
        outs.append(runner.step(chunks, copy_outputs=True))
    ref.step(steps[0])
    for chunks, got in zip(steps[1:], outs):
        assert_logits_close(ref.step(chunks), got)
