"""Compiling Triton kernels ahead (fullgraph.kernels.compile_ahead): launch dispatch, the on/off rules,
and, on a GPU, that a run under it compiles without running while the real launch then runs."""
import pytest
import torch

import fullgraph.env
from fullgraph.kernels import compile_ahead as ahead
from fullgraph.kernels import kv_write


class _FakeJit:
    """Stands in for a triton.jit function: records how it was called."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))


def test_outputs_of_kernels_compiled_ahead_are_zeros_not_uninitialised_memory(monkeypatch):
    """Under compile_ahead a kernel only compiles; torch's operators after it read its output
    (compute-sanitizer's initcheck flagged each read of the garbage)."""
    assert ahead.output((4, 3), torch.float32, torch.device("cpu")).shape == (4, 3)
    monkeypatch.setattr(ahead, "_active", True)
    out = ahead.output((4, 16), torch.bfloat16, torch.device("cpu"))
    assert out.dtype == torch.bfloat16 and out.shape == (4, 16) and bool((out == 0).all())


def test_kernel_launches_normally_and_only_compiles_when_active(monkeypatch):
    fake = _FakeJit()
    k = ahead.kernel(fake)
    k[(3, 2)](1, 2, BLOCK=4)
    monkeypatch.setattr(ahead, "_active", True)
    monkeypatch.setattr(ahead, "_submitted", set())
    t = torch.zeros(4)
    k[(5,)](7, t, BLOCK=8)
    k[(6,)](7, torch.ones(4), BLOCK=8)    # the same variant again (another tensor): submitted once
    k[(5,)](8, t, BLOCK=8)                # another scalar value: submitted (finer than Triton's key)
    k[(5,)](7, t.half(), BLOCK=8)         # another dtype
    k[(5,)](7, t, BLOCK=16)               # another constexpr
    calls = [(how, grid, tuple(str(a.dtype) if isinstance(a, torch.Tensor) else a for a in args), kw)
             for how, grid, args, kw in fake.calls]
    assert calls == [("launch", (3, 2), (1, 2), {"BLOCK": 4})] + [
        ("warmup", (5,), args, {"BLOCK": b}) for args, b in
        [((7, "torch.float32"), 8), ((8, "torch.float32"), 8), ((7, "torch.float16"), 8), ((7, "torch.float32"), 16)]]


def test_off_without_cuda_or_when_disabled(monkeypatch):
    monkeypatch.setenv(fullgraph.env.COMPILE_WORKERS, "0")
    assert ahead.workers() == 0
    calls = []
    assert ahead.compile_runs([lambda: calls.append(1)]) == 0.0
    assert calls == []  # runs that only collect variants are skipped when nothing compiles ahead
    with ahead.compile_ahead() as active:
        assert not active and not ahead._active


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rule")
def test_off_on_cpu(monkeypatch):
    monkeypatch.delenv(fullgraph.env.COMPILE_WORKERS, raising=False)
    assert ahead.workers() == 0


@pytest.mark.gpu
def test_run_under_compile_ahead_writes_nothing_then_the_launch_writes():
    torch.manual_seed(0)
    page, kvh, d = 16, 3, 40  # a shape no other test launches: a variant of its own
    cache = torch.randn(2, 4, page, kvh, d, device="cuda", dtype=torch.float16)
    before = cache.clone()
    key = torch.randn(5, kvh, d, device="cuda", dtype=torch.float16)
    value = torch.randn(5, kvh, d, device="cuda", dtype=torch.float16)
    slots = torch.tensor([17, 18, -1, 40, 63], device="cuda")
    with ahead.compile_ahead(num_workers=2) as active:
        assert active
        kv_write(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)  # compiled only
    kv_write(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[0, s // page, s % page], expect[1, s // page, s % page] = key[t], value[t]
    assert torch.equal(cache, expect)
