"""The regression suite: every scenario of ``fullgraph.testing`` (SCENARIOS.md) for every backend
and mode under test (``harness.CONFORMANCE_CASES``: the one list), against the unpadded eager
run of the same backend. The scenarios live in the package (``fg.testing``): these are thin calls.
"""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph import testing
from harness import CONFORMANCE_CASES, HAS_CUDA, Mode, Twin


@pytest.fixture(scope="module", params=CONFORMANCE_CASES)
def case(request) -> testing.Case:
    """One (backend, mode) for the whole module: its runners are built (captured, compiled) once."""
    backend, mode, dtype, preset = request.param
    if isinstance(backend, str) and backend not in fg.attention.backends.available_backends():
        pytest.skip(f"attention backend {backend!r} is not available")
    device = "cuda" if HAS_CUDA else "cpu"
    model = None if preset is None else fg.models.presets.build(preset, dtype=dtype or torch.float32, device=device)
    return testing.make_case(backend, mode, model=model, device=device, dtype=dtype)


@pytest.mark.parametrize("scenario", sorted(testing.SCENARIOS))
def test_scenario(case, scenario):
    row = testing.run_scenario(case, scenario)
    if row.ok is None:
        pytest.skip(row.detail)
    assert row.ok, f"scenario {scenario} ({row.title}), {row.mode}: {row.detail}"


@pytest.mark.gpu
def test_bf16_greedy_tokens_identical_over_32_steps():
    """8 mixed requests, bf16, full graphs vs eager, greedy for 32 steps."""
    for attention in [b for b in ("sdpa", "triton") if b in fg.attention.backends.available_backends()]:
        twin = Twin(Mode("full", attention, dtype=torch.bfloat16))
        reqs = [twin.new_request(200) for _ in range(8)]
        ref, got = twin.step([twin.chunk(r, 3 + 3 * i) for i, r in enumerate(reqs)])  # 108 tokens
        for _ in range(32):
            ids_ref, ids_got = ref.logits.argmax(-1).tolist(), got.logits.argmax(-1).tolist()
            assert ids_ref == ids_got, f"{attention}: greedy tokens differ: {ids_ref} vs {ids_got}"
            ref, got = twin.step([twin.chunk(r, 1, [t]) for r, t in zip(reqs, ids_ref)])
