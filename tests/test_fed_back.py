"""The fed-back ids kernel (``kernels.fed_back``) against its PyTorch expression: on the GPU when
there is one, else under the Triton interpreter; random ids, rows and feedback, several blocks."""
import pytest
import torch

from fullgraph.kernels.fed_back import BLOCK, fed_back_ids
from fullgraph.sampling import fed_back_ids as dispatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [1, 37, BLOCK + 5])
def test_fed_back_ids_match_the_torch_expression(n):
    g = torch.Generator().manual_seed(n)
    rows = 64
    ids = torch.randint(0, 50_000, (n,), generator=g)
    prev = torch.randint(-1, rows, (n,), generator=g)
    prev[::3] = -1                                         # staged ids kept
    feedback = torch.randint(50_000, 100_000, (rows,), generator=g)   # told apart from the staged ids
    want = torch.where(prev >= 0, feedback[prev.clamp(min=0)], ids)
    got = fed_back_ids(ids.to(DEVICE), prev.to(DEVICE), feedback.to(DEVICE)).cpu()
    assert got.tolist() == want.tolist()
    assert (got[::3] == ids[::3]).all() and ((got >= 50_000) == (prev >= 0)).all()
    assert dispatch(ids, prev, feedback).tolist() == want.tolist()      # the CPU path of the runner


def test_fed_back_ids_of_an_empty_step():
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert fed_back_ids(empty, empty, torch.ones(4, dtype=torch.int64, device=DEVICE)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
def test_fed_back_ids_on_gpu():
    test_fed_back_ids_match_the_torch_expression(BLOCK * 3 + 7)
