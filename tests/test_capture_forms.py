"""Linears of 2-32 rows measured at capture (``FULLGRAPH_LINEAR=timed``): ``linear_choice.forced``
(which form a step's linears take while a candidate is captured), ``graphs.pick`` (which timed form
is kept) and, on the GPU, a runner that captures each such size both ways, keeps the one ``pick``
says and replays exactly what that form computes."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import fullgraph as fg
import fullgraph.env
import fullgraph.plan
from fullgraph import graphs
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.kernels import linear_choice
from fullgraph.kernels.linear import NO_LIMIT
from test_linear_kernel import ref_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pick_keeps_the_default_unless_another_is_clearly_faster():
    assert graphs.pick([1.000, 0.995]) == 0          # within the margin: the default stays
    assert graphs.pick([1.000, 1.200]) == 0
    assert graphs.pick([1.000, 0.980]) == 1
    assert graphs.pick([1.000, 0.985, 0.970]) == 2   # the shortest of those past the margin
    assert graphs.pick([1.000, 0.5], margin=0.6) == 0
    assert graphs.pick([2.0]) == 0


@pytest.mark.parametrize("second, want", [(0.5, "b"), (0.999, "a"), (None, "a")])
def test_choose_keeps_the_form_pick_says_and_survives_a_form_that_fails(second, want, monkeypatch):
    """``GraphSet._choose`` with the CUDA parts stood in for: each later form is run and recorded
    within its own context, the graph kept is the picked form's, and a form whose capture raises is
    logged and left out (time ``inf``), the first one standing."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graph_set, entered, runs = graphs.GraphSet(torch.device("cpu")), [], []

    def form(name):
        def context():
            @contextlib.contextmanager
            def inside():
                entered.append(name)
                if second is None and name == "b":
                    raise RuntimeError("no cuBLAS here")
                yield
            return inside()
        return name, context

    def record(run, key):
        run(key)
        return f"graph of {entered[-1]}", 0.0
    monkeypatch.setattr(graph_set, "_record", record)
    monkeypatch.setattr(graph_set, "_replay_ms", lambda gs: [{"graph of a": 1.0, "graph of b": second}[g] for g in gs])
    graph_set.graphs[(8, True)] = "graph of a"
    name, times = graph_set._choose((8, True), [form("a"), form("b")], runs.append, warmups=2)
    assert (name, graph_set.graphs[(8, True)]) == (want, f"graph of {want}")
    assert times == (1.0, float("inf") if second is None else second)
    assert entered == ["b"] and runs == ([] if second is None else [(8, True)] * 3)  # two warm-ups, a recording


def test_choose_times_the_forms_on_the_timing_step_then_restores_the_capture_step(monkeypatch):
    """With ``timing``, the buffers hold the timing step while (and only while) the replays are
    timed: ``timing`` right before ``_replay_ms``, ``prepare`` right after; the warm-up and the
    recording of the other form run on the capture step."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graph_set, events = graphs.GraphSet(torch.device("cpu")), []
    monkeypatch.setattr(graph_set, "_record", lambda run, key: (run(key), ("graph", 0.0))[1])
    monkeypatch.setattr(graph_set, "_replay_ms", lambda gs: (events.append("replays"), [2.0, 1.0])[1])
    graph_set.graphs[(8, True)] = "graph of a"
    forms = [(name, contextlib.nullcontext) for name in ("a", "b")]
    name, _ = graph_set._choose((8, True), forms, lambda key: events.append(("run", key)), 1,
                                lambda key: events.append(("timing", key)), lambda key: events.append(("prepare", key)))
    assert name == "b"
    assert events == [("run", (8, True))] * 2 + [("timing", (8, True)), "replays", ("prepare", (8, True))]


@pytest.mark.parametrize("context", [0, 40, 1000])
@pytest.mark.parametrize("key", [(4, True), (8, True), (8, False)])
def test_the_timing_step_reads_its_context_and_writes_nothing(key, context):
    """``capture_plan(..., context=C)``: every sequence holds C tokens before its own (at most what
    ``max_model_len`` leaves), on pages of ``[1, num_blocks)`` (taken in turn, so distinct while
    there are enough), its block-table row filled that far and the null block past it; every slot
    -1; C = 0 is the capture step (the null block only)."""
    cfg = fg.RunnerConfig(max_num_seqs=8, max_num_tokens=8, max_model_len=128, block_size=16, num_blocks=40,
                          capture_sizes=(1, 4, 8))
    tokens, decode = key
    plan = fullgraph.plan.capture_plan(cfg, SdpaBackend.policy, cfg.num_blocks, *key, context=context)
    rows = plan.num_reqs
    q = np.diff(plan.query_start_loc[: rows + 1])
    held = min(context, cfg.max_model_len - int(q.max()))
    assert plan.decode_only is decode and plan.num_tokens == tokens and q.sum() == tokens
    assert (plan.seq_lens[:rows] == held + q).all() and plan.max_seq_len == held + int(q.max())
    assert (plan.slot_mapping == -1).all()
    pages = -(-(held + q) // cfg.block_size)
    ids = np.concatenate([plan.block_table[r, : pages[r]] for r in range(rows)])
    assert ((ids > 0) & (ids < cfg.num_blocks)).all() if held else (ids == 0).all()
    if held and len(ids) < cfg.num_blocks:
        assert len(set(ids.tolist())) == len(ids)
    assert all((plan.block_table[r, pages[r]:] == 0).all() for r in range(rows))
    starts = plan.query_start_loc[:rows]
    assert (plan.positions[starts] == held).all()


@pytest.mark.parametrize("setting", linear_choice.AUTO)
@pytest.mark.parametrize("impl", linear_choice.TUNED)
@pytest.mark.parametrize("epilogue", ["residual", "silu_and_mul"])
def test_a_forced_form_serves_the_few_row_steps_and_computes_the_same(impl, epilogue, setting, monkeypatch):
    """Within ``forced``, ``auto`` (and ``timed``) gives 2-32 rows the named form, on any device
    (here: the split-K kernel under the interpreter, or cuBLAS with the norm and the activation as
    kernels of their own); one row keeps the one-row kernel and more than 32 rows what they take
    anyway; on leaving, the default."""
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: setting)
    gen = torch.Generator(DEVICE).manual_seed(3)
    m, n, k = 5, 24, 40
    x, w = torch.randn(m, k, device=DEVICE, generator=gen), torch.randn(n, k, device=DEVICE, generator=gen)
    g = 1 + 0.2 * torch.randn(k, device=DEVICE, generator=gen)
    residual = torch.randn(m, n, device=DEVICE, generator=gen) if epilogue == "residual" else None
    activation = "none" if residual is not None else epilogue
    more = torch.randn(linear_choice.SKINNY_ROWS + 1, 8, device=DEVICE)
    default, more_default = linear_choice.choose(x), linear_choice.choose(more)
    with linear_choice.forced(impl):
        assert linear_choice.choose(x) == linear_choice.choose(x[:2]) == impl
        assert linear_choice.choose(x[:1]) == "triton"
        assert linear_choice.choose(more) == more_default   # 33 rows and more: not the split-K kernel's
        got = torch.ops.fullgraph.linear(x, w, None, activation, NO_LIMIT, g, 1e-6, residual)
    assert linear_choice.choose(x) == default == ("skinny" if x.is_cuda else "triton")
    torch.testing.assert_close(got.double(), ref_linear(x, w, None, activation, NO_LIMIT, g, 1e-6, residual),
                               rtol=1e-5, atol=1e-4)


def test_the_cublas_form_runs_the_layers_unfused_flow(monkeypatch):
    """Within ``forced("cublas")`` steps of 2-32 rows leave the kernel path (``kernel_path``: the
    layers' fused flow and the fused projections), so the candidate is the flow
    ``FULLGRAPH_LINEAR=cublas`` runs, with the fused add + norm launches; one row keeps it, and the
    split-K form and leaving ``forced`` give the layers' own limit back."""
    from fullgraph.models import layers
    monkeypatch.setattr(layers, "use_kernels", lambda x: True)   # as on CUDA
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    assert layers.kernel_path(x, 32) and layers.kernel_path(x[:1], 32) and not layers.kernel_path(x, 4)
    with linear_choice.forced("cublas"):
        assert not layers.kernel_path(x, 32) and not layers.kernel_path(x[:2], 32)
        assert layers.kernel_path(x[:1], 32)
        with linear_choice.forced("skinny"):
            assert layers.kernel_path(x, 32)
    assert layers.kernel_path(x, 32)


def test_forced_nests_restores_on_error_and_refuses_other_forms(monkeypatch):
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "auto")
    x = torch.randn(4, 8, device=DEVICE)
    with linear_choice.forced("cublas"):
        with pytest.raises(RuntimeError, match="inner"):
            with linear_choice.forced("skinny"):
                assert linear_choice.choose(x) == "skinny"
                raise RuntimeError("inner")
        assert linear_choice.choose(x) == "cublas"
    with pytest.raises(ValueError, match="triton"):
        with linear_choice.forced("triton"):
            pass
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "cublas")   # a pinned setting wins
    with linear_choice.forced("skinny"):
        assert linear_choice.choose(x) == "cublas"


def test_which_steps_are_captured_both_ways(monkeypatch):
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "timed")
    half = (torch.bfloat16, torch.float16)
    assert [r for r in (1, 2, 16, 32, 33, 64) if linear_choice.tunable(r, torch.bfloat16)] == [2, 16, 32]
    assert all(linear_choice.tunable(8, d) for d in half) and not linear_choice.tunable(8, torch.float32)
    def names(key, kept, dtype=torch.bfloat16):
        return [name for name, _ in linear_choice.capture_forms(key, dtype, kept)]

    assert names((8, True), {(8, True): "cublas"}) == list(linear_choice.TUNED)   # a decode graph: timed
    assert names((8, False), {(8, True): "cublas"}) == ["cublas"]                 # its mixed graph: that form
    assert names((8, False), {}) == list(linear_choice.TUNED)                     # no decode graph of its size
    assert names((1, True), {}) == names((64, True), {}) == names((8, True), {}, torch.float32) == []
    with linear_choice.capture_forms((8, True), torch.bfloat16, {})[1][1]():
        assert linear_choice._forced == "cublas"
    assert linear_choice._forced is None
    for pinned in ("auto", "skinny", "cublas", "triton"):
        monkeypatch.setattr(fullgraph.env, "linear_impl", lambda pinned=pinned: pinned)
        assert not linear_choice.tunable(8, torch.bfloat16), pinned
        assert linear_choice.capture_forms((8, True), torch.bfloat16, {}) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("keep", linear_choice.TUNED)
def test_the_kept_form_is_what_replays(keep, monkeypatch):
    """A bf16 runner captures the decode-only graphs of sizes 4 and 8 both ways and keeps ``keep``
    (``pick`` made to say so), the mixed graphs of those sizes in that form: its replays (decode
    steps, and prompts of a few tokens) equal, bit for bit, the padded runner's steps run within
    ``forced(keep)``, and differ from the other form's (so the comparison can tell them apart)."""
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "timed")
    monkeypatch.setattr(graphs, "pick", lambda times, margin=0.0: linear_choice.TUNED.index(keep))
    model = fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=torch.bfloat16, device="cuda", seed=0)
    limits = dict(max_num_seqs=8, max_num_tokens=8, max_model_len=128, block_size=16, capture_sizes=(1, 4, 8))
    full = fg.FullGraphRunner(model, cudagraph="full", **limits)
    padded = fg.FullGraphRunner(model, cudagraph="padded", **limits)
    report = full.capture()
    assert not any(cache.any() for cache in full.kv_caches)  # the timing step (cached context) wrote nothing
    # timed in the decode-only graphs; the mixed graph of a size takes that form; one row has none
    assert sorted((key, name) for key, name, _ in report.chosen) == [((4, True), keep), ((8, True), keep)]
    assert all(len(times) == 2 and min(times) > 0 for _, _, times in report.chosen)
    assert full.stats()["forms"] == {(8, True): keep, (8, False): keep, (4, True): keep, (4, False): keep}
    rng = np.random.default_rng(1)
    other = next(f for f in linear_choice.TUNED if f != keep)
    for lengths in ((1, 1, 1), (1,) * 7, (1,), (3, 2)):   # decode steps of 3, 7 and 1 rows; a 5-token mixed step
        rows = len(lengths)
        pages = [full.blocks.allocate(2) for _ in range(rows)]
        assert [padded.blocks.allocate(2) for _ in range(rows)] == pages
        chunks = [fg.SeqChunk(rng.integers(0, 500, n).tolist(), 0, p) for n, p in zip(lengths, pages)]
        got = full.step(chunks)
        assert got.mode == "full"
        with linear_choice.forced(keep):
            want = padded.step(chunks)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        if sum(lengths) > 1:  # the same tokens on fresh pages, the other form
            fresh = [full.blocks.allocate(2) for _ in range(rows)]
            assert [padded.blocks.allocate(2) for _ in range(rows)] == fresh
            with linear_choice.forced(other):
                diff = padded.step([fg.SeqChunk(c.token_ids, 0, p) for c, p in zip(chunks, fresh)])
            assert not torch.equal(diff.logits, got.logits), f"{keep} and {other} computed the same bits"
            scale = got.logits.abs().max().clamp(min=1.0)
            assert ((diff.logits - got.logits).abs().max() / scale).item() < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_a_backend_that_refuses_the_timing_step_leaves_the_capture_step_to_time(monkeypatch):
    """A backend whose host planning refuses cached context (FlashAttention without paging) is
    asked about the timing step, never about a capture step; refused, the forms are timed on the
    capture step, and capture completes, the cache untouched."""
    asked = []

    def refuse(self, plan):
        asked.append(int(plan.seq_lens[: plan.num_reqs].max()))
        return "attends to cached context"
    monkeypatch.setattr(SdpaBackend, "prepare", refuse)
    monkeypatch.setattr(fullgraph.env, "linear_impl", lambda: "timed")
    model = fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=torch.bfloat16, device="cuda", seed=0)
    runner = fg.FullGraphRunner(model, cudagraph="full", attention="sdpa", max_num_seqs=8, max_num_tokens=8,
                                max_model_len=128, block_size=16, capture_sizes=(1, 4, 8))
    report = runner.capture()
    assert sorted(key for key, _, _ in report.chosen) == [(4, True), (8, True)]
    assert len(asked) == 2 and min(asked) > 1   # once per timed graph, each with its context
    assert not any(cache.any() for cache in runner.kv_caches)
