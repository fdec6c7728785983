"""``FULLGRAPH_FUSE=...,head32``: the LM head's GEMM writes float32 logits itself (cuBLAS, bf16 x
bf16 -> float32) instead of bf16 logits and a cast. On the GPU its logits are closer to float64
than the default path's (no bf16 rounding); off CUDA the switch changes nothing (the dtype
overload is CUDA-only)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fullgraph as fg
import fullgraph.env

HAS_CUDA = torch.cuda.is_available()


def model(device: str, tied: bool) -> fg.models.Llama:
    cfg = dataclasses.replace(fg.models.LlamaConfig.toy(), tie_word_embeddings=tied)
    return fg.models.Llama(cfg, dtype=torch.bfloat16, device=device, seed=3)


def logits(m, hidden, monkeypatch, fusions) -> torch.Tensor:
    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset(fusions))
    with torch.inference_mode():
        return m.compute_logits(hidden)


def reference(m, hidden) -> torch.Tensor:
    w = (m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight).double()
    return m.scale_logits(hidden.double() @ w.t())


@pytest.mark.parametrize("tied", [False, True])
def test_head32_changes_nothing_off_cuda(monkeypatch, tied):
    m = model("cpu", tied)
    hidden = torch.randn(5, m.embed_tokens.weight.shape[1], dtype=torch.bfloat16)
    a = logits(m, hidden, monkeypatch, {"layer", "rope"})
    b = logits(m, hidden, monkeypatch, {"layer", "rope", "head32"})
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the float32-output GEMM is cuBLAS's)")
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rows", [1, 32])
def test_head32_logits_are_float32_and_closer_to_float64(monkeypatch, tied, rows):
    m = model("cuda", tied)
    hidden = torch.randn(rows, m.embed_tokens.weight.shape[1], dtype=torch.bfloat16, device="cuda")
    ref = reference(m, hidden)
    default = logits(m, hidden, monkeypatch, {"layer", "rope"})
    head32 = logits(m, hidden, monkeypatch, {"layer", "rope", "head32"})
    assert head32.dtype == torch.float32 and head32.shape == default.shape
    err32, err = (head32.double() - ref).abs().max().item(), (default.double() - ref).abs().max().item()
    assert err32 <= err and err32 <= 1e-3 * ref.abs().max().item()
