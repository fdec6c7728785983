"""The greedy pick of a decode loop outside the graph (``sampling.greedy``, ``kernels/argmax.py``)
against the rule of the sampling kernel's greedy rows (float64 reference: NaN as -inf, ties to the
lowest id, nothing finite -> 0); on the GPU when there is one, else under the Triton interpreter;
small chunks so ties and maxima sit across chunk boundaries."""
import pytest
import torch

from fullgraph import sampling
from fullgraph.kernels.argmax import argmax

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")


def rows(vocab: int = 1300, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g) * 3
    x[1, [70, 1100]] = 60.0                               # a tie across chunks: the lowest id
    x[2, :] = -INF                                        # nothing finite: 0
    x[3, vocab - 1] = 80.0                                # the last id
    x[4, ::2] = float("nan")                              # NaN counts as -inf (torch.argmax would pick it)
    x[5, :] = -INF
    x[5, 777] = -5.0                                      # one finite token
    x[6, [300, 301]] = 50.0                               # a tie inside one chunk
    return x.to(dtype)


def want(x: torch.Tensor) -> list[int]:
    d = x.double()
    return torch.where(torch.isnan(d), -INF, d).argmax(-1).tolist()


@pytest.mark.parametrize("chunks,block", [(None, 1024), (5, 128), (40, 32), (1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_kernel_follows_the_greedy_rule(chunks, block, dtype):
    x = rows(dtype=dtype)
    got = argmax(x.to(DEVICE), num_chunks=chunks, block=block).cpu()
    assert got.dtype == torch.int64 and got.tolist() == want(x)
    assert got[1] == 70 and got[2] == 0 and got[3] == 1299 and got[4] % 2 == 1 and got[5] == 777 and got[6] == 300


def test_argmax_of_one_row_and_of_none():
    x = rows()[3:4]
    assert argmax(x.to(DEVICE), block=64).cpu().tolist() == [1299]
    assert argmax(torch.zeros(0, 50, device=DEVICE)).shape == (0,)


def test_sampling_greedy_is_the_same_rule_off_cuda():
    x = rows()
    assert sampling.greedy(x).tolist() == want(x)         # plain PyTorch on CPU tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
@pytest.mark.parametrize("batch", [1, 32, 64])
def test_greedy_on_gpu_at_a_real_vocabulary(batch):
    """V = 128,256 at the launch shape of each batch, bf16 and float32, with planted ties and NaN."""
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(batch, 128_256, generator=torch.Generator().manual_seed(batch)) * 3).to(dtype)
        x[0, [5, 128_000]] = 40.0
        x[-1, ::3] = float("nan")
        got = sampling.greedy(x.cuda()).cpu()
        assert got.tolist() == want(x) and got[0] == 5
