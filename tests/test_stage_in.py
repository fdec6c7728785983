"""The stage-in kernel (``kernels.stage_in``): the staged words copied exactly, handed-over ids
clamped over their slice and nothing else touched; under the Triton interpreter on the CPU, and on
the GPU from pinned host memory (a second step's bytes, never the first's)."""
import pytest
import torch

from fullgraph.kernels.stage_in import stage_in

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _area(n_words: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random staged words (host; pinned on a GPU machine) and a device area of other garbage."""
    src = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g)
    dst = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g).to(DEVICE)
    return (src.pin_memory() if CUDA else src), dst


@pytest.mark.parametrize("n_words,block", [(1, 1024), (37, 16), (1024 * 3 + 5, 1024)])
def test_stage_in_copies_every_word(n_words, block):
    src, dst = _area(n_words, torch.Generator().manual_seed(n_words))
    stage_in(src, dst, block=block)
    assert torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n_ids,block", [(1, 1024), (21, 8), (300, 64)])
def test_stage_in_writes_clamped_ids_over_their_slice(ids_dtype, n_ids, block):
    g = torch.Generator().manual_seed(n_ids)
    n_words, at, vocab = 2 * 512 + 40, 6, 1000       # an int64 field of 512 at word 6, then other fields
    src, dst = _area(n_words, g)
    field = dst[at: at + 2 * 512].view(torch.int64)
    ids = torch.randint(-50, vocab + 50, (n_ids,), generator=g)
    ids[0], ids[-1] = -7, vocab + 3                   # one clamped at each end
    stage_in(src, dst, ids.to(ids_dtype).to(DEVICE), field, vocab - 1, block=block)
    got, want = dst.cpu(), src.clone()
    want[at: at + 2 * 512].view(torch.int64)[:n_ids] = ids.clamp(0, vocab - 1)
    assert torch.equal(got, want)                     # the ids' slice and every other word


def test_stage_in_without_a_bound_clamps_at_the_int32_limit():
    src, dst = _area(64, torch.Generator().manual_seed(1))
    ids = torch.tensor([5, 2**40, -3])
    stage_in(src, dst, ids.to(DEVICE), dst[8:].view(torch.int64), None, block=16)
    assert dst[8:14].cpu().view(torch.int64).tolist() == [5, 2**31 - 1, 0]


def test_stage_in_reads_strided_ids():
    """Ids handed over as a strided view (a column of a bigger tensor) land in order."""
    g = torch.Generator().manual_seed(4)
    src, dst = _area(200, g)
    table = torch.randint(0, 1000, (9, 3), generator=g)
    stage_in(src, dst, table.to(DEVICE)[:, 1], dst[20:].view(torch.int64), 999, block=32)
    want = src.clone()
    want[20:].view(torch.int64)[:9] = table[:, 1]
    assert torch.equal(dst.cpu(), want)


def test_stage_in_refuses_mismatched_areas():
    src, dst = _area(16, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="one size"):
        stage_in(src[:8], dst)
    with pytest.raises(ValueError, match="id bound"):
        stage_in(src, dst, None, None, 2**31)
    with pytest.raises(ValueError, match="inside dst"):
        stage_in(src, dst, torch.ones(4, dtype=torch.int64, device=DEVICE),
                 torch.zeros(4, dtype=torch.int64, device=DEVICE), 10)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
def test_stage_in_reads_each_steps_host_bytes():
    """Pinned host words rewritten between two launches: the second copy sees the new ones (the
    host reads bypass the GPU's caches), with a step's ids written over their slice each time."""
    g = torch.Generator().manual_seed(3)
    src, dst = _area(20_000, g)
    field = dst[100: 100 + 2 * 64].view(torch.int64)
    for step in range(3):
        src.copy_(torch.randint(-2**31, 2**31 - 1, (20_000,), dtype=torch.int32, generator=g))
        ids = torch.randint(0, 128_256, (33,), generator=g)
        stage_in(src, dst, ids.to(DEVICE), field, 128_255)
        torch.cuda.synchronize()
        want = src.clone()
        want[100: 100 + 2 * 64].view(torch.int64)[:33] = ids
        assert torch.equal(dst.cpu(), want), f"step {step}"
