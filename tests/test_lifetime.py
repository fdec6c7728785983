"""A runner (and the engine or LLM around it) is freed when its last reference goes, without the
garbage collector: its KV cache, static buffers and graphs are released by ``del``, as a user
who swaps models in one process expects. A reference cycle (a bound method of the runner kept on
the runner, a closure over it) keeps all of that until a collection happens to run."""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

import fullgraph as fg
from harness import HAS_CUDA, LIMITS, toy_model


@contextlib.contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def referrers(obj) -> str:
    return "; ".join(f"{type(r).__name__}: {str(r)[:80]}" for r in gc.get_referrers(obj))


def assert_freed(ref: weakref.ref, what: str) -> None:
    obj = ref()
    assert obj is None, f"{what} outlived its last reference (held by {referrers(obj)})"


def stepped_runner(**overrides) -> fg.FullGraphRunner:
    runner = fg.FullGraphRunner(toy_model(), **{**LIMITS, **overrides})
    ids = runner.blocks.allocate(2)
    prompt = torch.randint(1, 500, (19,)).tolist()
    runner.step([fg.SeqChunk(prompt, 0, ids)])                   # a prefill, then a decode step
    out = runner.step([fg.SeqChunk([prompt[-1]], len(prompt), ids)])
    assert out.mode == runner.config.cudagraph                   # "full": the first step captured every size
    return runner


CPU_MODES = [dict(cudagraph="none"), dict(cudagraph="padded"), dict(cudagraph="padded", sampling=True),
             dict(cudagraph="padded", compile=True)]


@pytest.mark.parametrize("overrides", CPU_MODES, ids=["none", "padded", "padded-sampling", "padded-compile"])
def test_runner_freed_by_del(overrides):
    runner = stepped_runner(**overrides)
    ref = weakref.ref(runner)
    with collector_off():
        del runner
        assert_freed(ref, f"a runner ({overrides})")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", [False, True], ids=["logits", "sampling"])
def test_captured_runner_frees_its_memory(sampling):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runner = stepped_runner(cudagraph="full", sampling=sampling)
    held = torch.cuda.memory_allocated() - before
    ref = weakref.ref(runner)
    with collector_off():
        del runner
        assert_freed(ref, "a captured runner")
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
    assert left <= 0.01 * held, f"{left} of the runner's {held} bytes still allocated after del"


def test_engine_and_llm_freed_by_del():
    runner = fg.FullGraphRunner(toy_model(), sampling=True, cudagraph="padded", **LIMITS)
    engine = fg.Engine(runner)
    engine.add_request("a", torch.randint(1, 500, (11,)).tolist(), fg.SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    refs = weakref.ref(runner), weakref.ref(engine)
    with collector_off():
        del runner, engine
        assert_freed(refs[0], "an engine's runner")
        assert_freed(refs[1], "an engine")

    llm = fg.LLM(toy_model(), max_num_seqs=4, max_model_len=128, max_num_tokens=128,
                 cudagraph="full" if HAS_CUDA else "padded")
    assert len(llm.generate([torch.randint(1, 500, (5,)).tolist()], fg.SamplingParams(max_tokens=3))) == 1
    refs = weakref.ref(llm), weakref.ref(llm.engine.runner)
    with collector_off():
        del llm
        assert_freed(refs[0], "an LLM")
        assert_freed(refs[1], "an LLM's runner")
