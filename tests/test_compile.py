"""compile=True: equals eager, composes with the modes, zero recompiles after warm-up (Inductor CPU).
The regression scenarios in compiled mode run in test_regression (the "compile" conformance cases)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.compile import RecompileError
from harness import Mode, Twin, assert_logits_close, make_runner

COMPILED = Mode("padded", "sdpa", compile=True)


@pytest.fixture(scope="module")
def twin() -> Twin:
    """One compiled runner for the module (compiling is the slow part on CPU)."""
    t = Twin(COMPILED, validate=True)  # validate: strict, a recompile raises
    t.test.warmup()
    return t


def test_compiled_padded_equals_eager_over_every_bucket(twin):
    rng = np.random.default_rng(0)
    reqs = [twin.new_request(200) for _ in range(8)]
    for step in range(60):  # prefill chunks of every size, decode batches of every width
        live = reqs[: 1 + step % 8]
        if step % 3 == 0:
            chunks = [twin.chunk(r, int(rng.integers(1, 128 // len(live) + 1))) for r in live]
        else:
            chunks = [twin.chunk(r, 1) for r in live]
        if any(r.pos > 200 for r in live):
            break
        ref, got = twin.step(chunks)
        assert_logits_close(ref, got)
    stats = twin.test.stats()
    assert stats["compiled_graphs"] >= 2 and stats["recompiles_after_warmup"] == 0
    for r in reqs:
        twin.ref.blocks.free(r.blocks)
        twin.test.blocks.free(r.blocks)


def test_zero_recompiles_over_hundreds_of_steps(twin):
    runner = twin.test
    before, steps = runner.stats()["compiled_graphs"], runner.stats()["steps"]
    for size in runner.config.buckets:  # every bucket, decode and mixed, lengths growing
        batch = min(size, runner.config.max_num_seqs)
        per = size // batch
        blocks = [runner.blocks.allocate(-(-6 * (per + 1) // 16)) for _ in range(batch)]
        for i in range(6):  # a prefill chunk of the bucket's size, then a decode step
            runner.step([fg.SeqChunk([5] * per, i * (per + 1), b) for b in blocks])
            runner.step([fg.SeqChunk([7], i * (per + 1) + per, b) for b in blocks])
        for b in blocks:
            runner.blocks.free(b)
    stats = runner.stats()
    assert stats["steps"] - steps >= 200
    assert stats["compiled_graphs"] == before and stats["recompiles_after_warmup"] == 0


def test_compiled_unpadded_mode_matches():
    runner = make_runner(Mode("none", compile=True))
    ref = make_runner(Mode("none"))
    ids = runner.blocks.allocate(4)
    ref.blocks.allocate(4)
    for start, n in [(0, 11), (11, 1), (12, 20), (32, 1)]:
        chunk = [fg.SeqChunk(list(range(start, start + n)), start, ids)]
        torch.testing.assert_close(runner.step(chunk).logits, ref.step(chunk).logits, atol=1e-5, rtol=1e-5)
    assert runner.stats()["recompiles_after_warmup"] == 0


@pytest.mark.parametrize("strict", [True, False])
def test_recompile_after_warmup_raises_in_strict_mode_and_logs_otherwise(twin, strict, caplog):
    runner = make_runner(COMPILED, validate=strict)
    runner.warmup()
    ids = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk([1, 2], 0, ids)])
    runner.model.layers[0].self_attn.attn.scale *= 1.5  # a host constant the graph baked in
    try:
        if strict:
            with pytest.raises(RecompileError, match="recompiled after warm-up"):
                runner.step([fg.SeqChunk([3], 2, ids)])
        else:
            with caplog.at_level(logging.WARNING, logger="fullgraph"):
                runner.step([fg.SeqChunk([3], 2, ids)])
            assert runner.stats()["recompiles_after_warmup"] >= 1
            assert any("recompiled after warm-up" in r.message for r in caplog.records)
    finally:
        runner.model.layers[0].self_attn.attn.scale /= 1.5


def test_custom_ops_are_the_registered_op_when_compiled_and_the_function_when_eager():
    """``_compat.custom_op``: eager calls skip the dispatcher (host time, and no torch._dynamo import
    at the first call); torch.compile and dispatch modes see the one registered op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fullgraph._compat import custom_op

    calls = []

    @custom_op("fullgraph_test::scale2", mutates_args=())
    def scale2(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x * 2

    @scale2.register_fake
    def _(x):
        return torch.empty_like(x)

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(5)
    torch.testing.assert_close(scale2(x), x * 2)
    with Seen():
        torch.testing.assert_close(scale2(x), x * 2)
    assert Seen.ops[0] == "fullgraph_test.scale2.default"
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: scale2(t) + 1, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    assert any("fullgraph_test.scale2" in t for t in targets), targets
    assert scale2.op is not scale2 and calls[0] is False
