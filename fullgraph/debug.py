"""The debugging ladder as a tool: run one step in every mode and find where outputs diverge.

``compare(runner_or_model, chunks)`` runs the same step eagerly (``"none"``), on the padded
static buffers (``"padded"``), as a CUDA graph (``"full"``) and compiled (``"compile"``, with
graphs where CUDA is, and ``"compile-padded"``), each in a fresh runner holding its own copy of
the KV cache. Forward hooks copy every decoder layer's
output into static debug buffers; under ``"full"`` the copies are captured into the graph, so
the report sees what the replay computed. The report gives, per layer and per real request,
max |delta| of the hidden states against ``"none"``, the first layer past a dtype-aware
tolerance, and the logits' top-1 agreement and top1-top2 margin.

How to read it: ``none`` vs ``padded`` differ -> padding/metadata bug; ``padded`` vs ``full``
-> capture bug (host value baked in, moved address, allocation during capture); ``full`` vs
``compile`` -> compiler issue. The first divergent layer says where to look.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import RunnerConfig
from .plan import SeqChunk, plan_step
from .runner import FullGraphRunner

MODES = ("none", "padded", "full", "compile", "compile-padded")


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance on hidden states: float32 rounding vs half-precision rounding."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


@dataclass
class ModeResult:
    mode: str
    layer_delta: torch.Tensor | None = None   # (num_layers, num_reqs) max |delta| vs "none"
    first_divergent_layer: int | None = None
    top1_agree: list[bool] = field(default_factory=list)
    skipped: str | None = None                 # why this mode did not run here


@dataclass
class CompareReport:
    modes: dict[str, ModeResult]
    margin: list[float]                        # top1 - top2 of the reference logits, per request
    tolerance: float

    @property
    def clean(self) -> bool:
        return all(r.skipped or (r.first_divergent_layer is None and all(r.top1_agree))
                   for r in self.modes.values())

    def __str__(self) -> str:
        lines = [f"{'mode':>8} | first divergent layer | max|delta| per layer (worst request) | top-1 agree"]
        for r in self.modes.values():
            if r.skipped:
                lines.append(f"{r.mode:>8} | skipped: {r.skipped}")
                continue
            worst = " ".join(f"{v:.1e}" for v in r.layer_delta.max(dim=1).values.tolist()) if r.layer_delta.numel() else "-"
            first = "-" if r.first_divergent_layer is None else str(r.first_divergent_layer)
            lines.append(f"{r.mode:>8} | {first:>21} | {worst} | {sum(r.top1_agree)}/{len(r.top1_agree)}")
        lines.append(f"top1-top2 margin of the reference logits per request: "
                     f"{' '.join(f'{m:.3g}' for m in self.margin)}; tolerance {self.tolerance:g} (relative)")
        lines.append("verdict: " + ("no divergence" if self.clean else "DIVERGENCE (see the first divergent layer)"))
        return "\n".join(lines)


def _mode_config(base: RunnerConfig, mode: str, cuda: bool, bucket: int) -> RunnerConfig | str:
    if mode == "full" and not cuda:
        return "needs CUDA"
    graph = "full" if cuda else "padded"
    cudagraph, compile_ = {"none": ("none", False), "padded": ("padded", False), "full": ("full", False),
                           "compile": (graph, True), "compile-padded": ("padded", True)}[mode]
    return base.replace(cudagraph=cudagraph, compile=compile_, validate=False, capture_sizes=(bucket,),
                        max_capture_size=None)


def _run_mode(runner: FullGraphRunner, chunks: Sequence[SeqChunk], source: FullGraphRunner | None,
              num_tokens: int):
    """(per-layer hidden states of the real tokens, logits) of one step in a fresh runner holding
    a copy of ``source``'s KV cache and pages."""
    if source is not None:
        for dst, src in zip(runner.kv_caches, source.kv_caches):
            dst.copy_(src)
        runner.blocks.copy_from(source.blocks)
    layers = runner.model.layers
    buffers: list[torch.Tensor | None] = [None] * len(layers)

    def hook(i):
        def copy_out(module, args, out):
            if isinstance(out, tuple):  # (output, residual stream) of a layer that leaves them unsummed
                out = out[0] if out[1] is None else out[0] + out[1]
            if buffers[i] is None:  # first (eager) call: before any capture
                buffers[i] = out.new_full((runner.config.max_num_tokens, out.shape[-1]), float("nan"))
            buffers[i][: out.shape[0]].copy_(out)
        return copy_out

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        if runner.config.cudagraph == "full" or runner.config.compile:
            runner.warmup()  # the graphs (and compiled code) include the hooks' copies
        logits = runner.step(list(chunks)).logits
    finally:
        for h in handles:
            h.remove()
    return [b[:num_tokens].float() for b in buffers], logits


@torch.inference_mode()
def compare(target: FullGraphRunner | nn.Module, chunks: Sequence[SeqChunk], modes: Sequence[str] = MODES,
            progress=None, **config_overrides) -> CompareReport:
    """Run one step in each mode (each with a fresh copy of the KV cache) and report divergence.

    ``target``: a runner (its model, config and KV cache contents are used; it is not modified)
    or a model (a runner config is built from ``config_overrides``). ``progress(mode)`` is called
    as each mode starts (compiling takes a while). The model must expose its
    decoder layers as ``model.layers``; a layer returns its hidden state, or ``(output, residual)``
    whose sum is the hidden state.
    """
    if isinstance(target, FullGraphRunner):
        model, base, kv = target.model, target.config.replace(**config_overrides), target
    else:
        model, base, kv = target, RunnerConfig(**config_overrides), None
    if not isinstance(getattr(model, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `layers` ModuleList: compare() hooks decoder layers")
    if set(modes) - set(MODES) or "none" not in modes:
        raise ValueError(f"modes must include 'none' (the reference) and come from {MODES}, got {tuple(modes)}")
    cuda = next(model.parameters()).device.type == "cuda"
    reference = FullGraphRunner(model, base.replace(cudagraph="none", compile=False, validate=False))
    plan = plan_step(chunks, reference.config, reference.policy, num_blocks=reference.config.num_blocks)
    runs: dict[str, tuple | str] = {"none": _run_mode(reference, chunks, kv, plan.num_tokens)}
    for mode in [m for m in modes if m != "none"]:
        if progress is not None:
            progress(mode)
        cfg = _mode_config(reference.config, mode, cuda, plan.num_tokens_padded)
        runs[mode] = cfg if isinstance(cfg, str) else _run_mode(FullGraphRunner(model, cfg), chunks, kv, plan.num_tokens)
    return _report(runs, plan, tolerance(next(model.parameters()).dtype))


def _report(runs: dict, plan, tol: float) -> CompareReport:
    ref_hidden, ref_logits = runs["none"]
    qsl = plan.query_start_loc
    top2 = ref_logits.float().topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).tolist()
    results = {}
    for mode, run in runs.items():
        if isinstance(run, str):
            results[mode] = ModeResult(mode, skipped=run)
            continue
        hidden, logits = run
        delta = torch.zeros(len(hidden), plan.num_reqs)
        diverged = torch.zeros(len(hidden), plan.num_reqs, dtype=torch.bool)
        for layer, (h, h_ref) in enumerate(zip(hidden, ref_hidden)):
            for r in range(plan.num_reqs):
                rows = slice(int(qsl[r]), int(qsl[r + 1]))
                d = (h[rows] - h_ref[rows]).abs().max()
                scale = h_ref[rows].abs().max().clamp(min=1.0)
                delta[layer, r] = d if torch.isfinite(d) else float("inf")
                diverged[layer, r] = not bool(delta[layer, r] <= tol * scale)
        bad_layers = diverged.any(dim=1).nonzero()
        results[mode] = ModeResult(
            mode, layer_delta=delta, first_divergent_layer=int(bad_layers[0]) if len(bad_layers) else None,
            top1_agree=(logits.argmax(-1) == ref_logits.argmax(-1)).tolist())
    return CompareReport(results, margin, tol)
