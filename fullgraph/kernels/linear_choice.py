"""Which kernel serves a linear layer: ours, the split-K one or cuBLAS.

One row runs our weight-streaming kernel (``linear.launch``: faster than cuBLAS there, and
the only one that fuses the RMSNorm on load and the residual add). 2-32 rows run the split-K
weight-streaming kernel (``skinny_linear``: x is read once per 64-128 weight rows, its weight tiles
pipelined through shared memory), with which the models fuse the norm, the residual add and RoPE +
the KV write into their projections (``models.layers.fused_max_rows``): H100, 2026-12-06,
``gpu_suite.sh skinny``, overlapped decode step against cuBLAS with the norm, the activation and
the add as launches of their own (:func:`unfused`): llama-1b batch 8 / 32 1.435 / 1.854 -> 1.386 /
1.771 ms, SmolLM2 0.930 / 1.305 -> 0.815 / 1.141, Llama-8B 6.597 / 7.890 -> 6.577 / 7.718. At 64
rows cuBLAS is faster (llama-1b 2.339 against 2.409, SmolLM2 1.646 against 1.756), so 33-64 rows
take cuBLAS, as every longer step does. ``FULLGRAPH_LINEAR`` (``fullgraph.env``) overrides:
``skinny`` for 2-64 rows, ``cublas`` for all of them (the unfused layer), ``triton`` for our
``tl.dot`` path (about twice cuBLAS's time at 32 rows: benchmarks and tests).
Under the Triton interpreter (no CUDA) ``auto`` takes ours: the kernel under test.

Measured, not assumed (``FULLGRAPH_LINEAR=timed``, the default): where the split-K kernel serves a
step (2-32 rows), the runner captures that step's graph twice, once as :func:`forced` ``("cublas")``
(the layers' unfused flow: the products by cuBLAS, the add + norm and RoPE + the KV write as kernels
of their own), replays both and keeps the faster (``graphs.GraphSet.capture``; the choice per
captured size is in the capture report); ``auto`` keeps the split-K kernel without timing. A linear
timed alone would mislead: timed eagerly, back to back, launch overhead and a cache-resident weight
decided it, and chose ours where it is twice as slow; a whole step's replay streams every weight
from memory as a served step does, and its kernels overlap as theirs do. The replays are timed
on a step whose sequences hold :data:`CONTEXT` tokens each (read, never written): on the capture
step, which reads next to nothing of the cache, the split-K form won by 6-22% everywhere (H100,
2026-12-07), while at context 1024 cuBLAS was 1.6% faster for llama-1b's 32 rows. Timed over
context, with the cuBLAS candidate in the unfused flow (:func:`fused_rows`), it keeps the form whose
graph replays faster at every shape measured (H100s: llama-1b and SmolLM2, 8 and 32 rows). On the
H200 it keeps cuBLAS for llama-1b's 32 rows, whose overlapped step it makes 1.506 -> 1.390 ms, and
the split-K kernel for Phi-3-Small's 16 (BENCHMARKS.md). Its cost is one more capture and 80
replays per such size at capture time.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .. import env
from . import activation as act
from . import norm

MAX_ROWS = 64   # more rows take cuBLAS (with the norm and the activation as kernels of their own)
SKINNY_ROWS = 32  # ``auto`` on CUDA: 2 to this many rows take the split-K kernel, more take cuBLAS
TUNED = ("skinny", "cublas")  # what a captured step of 2-32 rows is timed with, the default first
AUTO = ("auto", "timed")      # the settings under which 2-32 rows take the split-K kernel unless forced
CONTEXT = 1024  # tokens each sequence holds in the step the forms are timed on (at most max_model_len allows)

_forced: str | None = None  # :func:`forced`: what ``auto`` gives the split-K kernel's steps now


def max_skinny_rows() -> int:
    """The most rows that take the split-K kernel on CUDA (and fuse the layer around it), as
    ``FULLGRAPH_LINEAR`` says: ``auto`` :data:`SKINNY_ROWS`, ``skinny`` :data:`MAX_ROWS`, else 1
    (none: one row takes the one-row kernel); ``timed`` as ``auto``."""
    impl = env.linear_impl()
    return SKINNY_ROWS if impl in AUTO else MAX_ROWS if impl == "skinny" else 1


def choose(x: torch.Tensor) -> str:
    """Which kernel serves a linear of ``x``'s rows: ``"triton"`` (``linear.launch``), ``"skinny"``
    (``skinny_linear.launch``) or ``"cublas"`` (:func:`unfused`). One row always takes
    ``linear.launch`` (H100, ``sweep_linear.py --skinny``: 4.9-23.1 us against the split-K kernel's
    6.4-25.0 on llama-1b's four matrices); 2 to :func:`max_skinny_rows` rows on CUDA the split-K one,
    or within :func:`forced` what it says (on any device: the tests force either form on the CPU)."""
    rows = x.shape[0]
    if rows > MAX_ROWS:  # prefill: tiles of every row would not fit
        return "cublas"
    if rows == 1:   # the one-row kernel beats the split-K one at every layer shape measured
        return "triton"
    impl = env.linear_impl()
    if impl in AUTO and _forced is not None and rows <= max_skinny_rows():
        return _forced                      # a candidate being captured (:func:`forced`)
    if impl in AUTO and not x.is_cuda:     # the Triton interpreter: the kernel under test
        return "triton"
    if impl in AUTO or impl == "skinny":   # the one limit the layers fuse by, too
        return "skinny" if rows <= max_skinny_rows() else "cublas"
    return impl


def tunable(rows: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA step of ``rows`` tokens in ``dtype`` is captured both ways (:data:`TUNED`):
    ``FULLGRAPH_LINEAR=timed``, half precision (the kernel path: float32 steps take cuBLAS either
    way) and 2 to :func:`max_skinny_rows` rows."""
    return (env.linear_impl() == "timed" and dtype in (torch.bfloat16, torch.float16)
            and 2 <= rows <= max_skinny_rows())


def capture_forms(key: tuple[int, bool], dtype: torch.dtype, kept: dict) -> list[tuple[str, Callable]]:
    """The forms (name, context) a captured step's graph ``key`` (tokens, decode-only) in ``dtype`` is
    recorded in (``GraphSet.capture``'s variants): none unless :func:`tunable`; for a decode-only
    graph both (:data:`TUNED`), to be timed; for a mixed one the form ``kept`` (``GraphSet.forms``)
    for its size's decode-only graph alone (the same linears over the same rows), or both if none."""
    rows, decode = key
    if not tunable(rows, dtype):
        return []
    decided = None if decode else kept.get((rows, True))
    return [(impl, functools.partial(forced, impl)) for impl in ((decided,) if decided else TUNED)]


def fused_rows(fuse_rows: int) -> int:
    """The most rows the layers fuse around their linears now (``models.layers.kernel_path``):
    ``fuse_rows``, theirs from construction, or 1 within :func:`forced` ``("cublas")``, whose steps
    of 2-32 rows then run the layers' unfused flow (cuBLAS products, the fused add + norm launches,
    RoPE in the KV write), the flow ``FULLGRAPH_LINEAR=cublas`` runs. Fused around a cuBLAS product
    (:func:`unfused`), a layer runs two more launches (the residual added outside the add + norm
    launch: ``addmm`` copies it into its output first): timed so, cuBLAS's llama-1b step of 32 rows
    took 1.762 ms where the unfused flow replays in 1.664 (H100, 2026-12-07)."""
    return 1 if _forced == "cublas" else fuse_rows


@contextlib.contextmanager
def forced(impl: str) -> Iterator[None]:
    """Within it, ``auto``'s (and ``timed``'s) steps of 2-32 rows take ``impl`` (one of
    :data:`TUNED`) instead of the split-K kernel: with ``"cublas"`` the layers run their unfused flow
    around it (:func:`fused_rows`); a direct call of the fused ops runs the norm, the activation and
    the residual add as launches of their own (:func:`unfused`). A graph captured within it runs
    that form ever after; the runner captures the candidates this way (under ``torch.compile``, one
    more compile of the forward for the cuBLAS form)."""
    global _forced
    if impl not in TUNED:
        raise ValueError(f"linear_choice.forced: expected one of {TUNED}, got {impl!r}")
    previous, _forced = _forced, impl
    try:
        yield
    finally:
        _forced = previous


def unfused(x, w, b, activation, limit, norm_weight, eps, residual) -> torch.Tensor:
    """What ``linear.linear`` computes, with cuBLAS for the product: the norm and the gated activation
    as our kernels, the residual added by cuBLAS's epilogue (``addmm``) where there is no bias."""
    if norm_weight is not None:
        x = norm.rms_norm(x, norm_weight, eps)
    if residual is not None and b is None:
        return torch.addmm(residual, x, w.t())
    y = F.linear(x, w, b)
    if activation == "silu_and_mul":
        y = act.silu_and_mul(y)
    elif activation == "gegelu":
        y = act.gegelu(y, limit)
    return y if residual is None else y.add_(residual)
