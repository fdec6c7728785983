"""A LayerNorm applied on load (``FULLGRAPH_FUSE=...,layernorm``): the per-weight-row constants the
kernels read (``kernels.layer_norm_sums``) follow the weights they come from, in place, in eager
steps, under ``torch.compile`` and in captured graphs (``refresh_norms_on_load``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fullgraph as fg
import fullgraph.env
import fullgraph.kernels
from fullgraph.models.layers import LayerNorm, Linear, refresh_norms_on_load


def reference_sums(lin: Linear, norm: LayerNorm) -> torch.Tensor:
    w = lin.weight.double()
    return torch.stack((w @ norm.weight.double(), w @ norm.bias.double()), dim=1)


@pytest.fixture
def fused(monkeypatch):
    """Models and layers built inside read the fusions with ``layernorm`` on."""
    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset({"layer", "rope", "layernorm"}))


def pair(seed: int = 0) -> tuple[Linear, LayerNorm]:
    torch.manual_seed(seed)
    lin, norm = Linear(24, 40), LayerNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
        norm.bias.normal_(0.0, 0.5)
    return lin, norm


def test_sums_follow_in_place_changes_and_replaced_parameters(fused, monkeypatch):
    lin, norm = pair()
    calls = []
    real = fullgraph.kernels.layer_norm_sums
    monkeypatch.setattr(fullgraph.kernels, "layer_norm_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    sums = lin.layer_norm_sums(norm)
    torch.testing.assert_close(sums.double(), reference_sums(lin, norm), rtol=1e-6, atol=1e-6)
    assert lin.layer_norm_sums(norm) is sums and len(calls) == 1, "unchanged weights: no recomputation"
    with torch.no_grad():
        norm.bias.mul_(-2.0)                        # in place: a new version of the same tensor
    assert lin.layer_norm_sums(norm) is sums and len(calls) == 2, "refreshed in place"
    torch.testing.assert_close(sums.double(), reference_sums(lin, norm), rtol=1e-6, atol=1e-6)
    lin.weight = nn.Parameter(torch.randn(40, 24))  # a new tensor (as loading with share=True makes)
    assert lin.layer_norm_sums(norm) is sums and len(calls) == 3
    torch.testing.assert_close(sums.double(), reference_sums(lin, norm), rtol=1e-6, atol=1e-6)
    other = LayerNorm(24, 1e-5)                     # another norm: its own sums
    torch.testing.assert_close(lin.layer_norm_sums(other).double(), reference_sums(lin, other), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset", ["phi3", "llama"])
@pytest.mark.parametrize("on", [True, False], ids=["layernorm", "off"])
def test_refresh_prepares_the_projections_that_apply_a_layer_norm(preset, on, monkeypatch):
    fusions = {"layer", "rope", "layernorm"} if on else {"layer", "rope"}
    monkeypatch.setattr(fullgraph.env, "fused", lambda: frozenset(fusions))
    model = (fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy()) if preset == "phi3"
             else fg.models.Llama(fg.models.LlamaConfig.toy()))
    refresh_norms_on_load(model)
    prepared = {name for name, m in model.named_modules() if isinstance(m, Linear) and m._layer_norm_sums is not None}
    if preset == "phi3" and on:
        assert prepared == {f"layers.{i}.{p}" for i in range(len(model.layers))
                            for p in ("self_attn.query_key_value", "mlp.up_proj")}
        for layer in model.layers:
            for norm, lin in layer.projections_after_norms():
                torch.testing.assert_close(lin._layer_norm_sums.double(), reference_sums(lin, norm), rtol=1e-6,
                                           atol=1e-6)
    else:
        assert prepared == set(), "RMSNorm models and the fusion switched off derive nothing"


def test_a_compiled_forward_reads_the_refreshed_sums_without_recompiling(fused, monkeypatch):
    """Dynamo traces the kernel path with the sums as they stand (no refresh inside the trace); a
    refresh after an in-place change updates what the compiled code reads, with no recompile."""
    monkeypatch.setattr(Linear, "uses_kernel", lambda self, x: True)   # the CUDA decode path, on the CPU
    lin, norm = pair(1)
    lin.refresh_layer_norm_sums(norm)
    x = torch.randn(1, 24) + 2.0

    def want() -> torch.Tensor:
        xn = torch.nn.functional.layer_norm(x.double(), (24,), norm.weight.double(), norm.bias.double(), 1e-5)
        return xn @ lin.weight.double().t() + lin.bias.double()

    torch._dynamo.reset()
    step = torch.compile(lambda t: lin(t, norm), fullgraph=True, backend="eager")
    torch.testing.assert_close(step(x).double(), want(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        norm.weight.mul_(0.5)
        norm.bias.add_(1.0)
    lin.refresh_layer_norm_sums(norm)
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(step(x).double(), want(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_apply_the_layer_norm_on_load_and_follow_a_refresh(fused):
    """Phi-3-Small (toy, bf16) decoding two requests, in one-row steps (the LayerNorms on load) and
    two-row ones (a LayerNorm kernel each): the captured graphs give the eager steps' logits; after
    an in-place change of every LayerNorm, eager steps refresh on their own and the graphs after
    ``refresh_norms_on_load``."""
    model = fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), dtype=torch.bfloat16, device="cuda")
    runners = [fg.FullGraphRunner(model, max_num_seqs=2, max_num_tokens=32, max_model_len=128, cudagraph=mode,
                                  attention="triton") for mode in ("full", "none")]
    ids = [r.blocks.allocate(2) for r in runners]
    prompt = [5, 9, 2, 7, 11]
    other = [r.blocks.allocate(2) for r in runners]

    def logits(pos: int, tokens: list[int], together: bool) -> list[torch.Tensor]:
        """Both requests' step: ``together`` as one step of two rows, else as two one-row steps; each
        runner's logits, (2, vocab)."""
        out = []
        for r, i, j in zip(runners, ids, other):
            chunks = [fg.SeqChunk(tokens, pos, i), fg.SeqChunk(tokens, pos, j)]
            out.append(r.step(chunks).logits.float() if together
                       else torch.cat([r.step([c]).logits.float() for c in chunks]))
        return out

    logits(0, prompt, together=True)
    for pos, token, together in ((5, 3, False), (6, 14, True)):
        graph, eager = logits(pos, [token], together)
        assert not graph.isnan().any()   # (dummy token ids are -inf)
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-2)
    assert all(lin._layer_norm_sums is not None for layer in model.layers for _, lin in layer.projections_after_norms())
    with torch.no_grad():
        for layer in model.layers:
            layer.input_layernorm.bias.add_(0.5)
            layer.post_attention_layernorm.weight.mul_(1.5)
    refresh_norms_on_load(model)
    for pos, token, together in ((7, 8, False), (8, 1, True)):
        graph, eager = logits(pos, [token], together)
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-2)
