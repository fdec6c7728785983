"""Every environment switch fullgraph reads, in one place, each with its one rule.

Nothing deep in the code reads ``os.environ``: it asks here. This module imports nothing of the
project (kernels may use it too). A switch marked "read once" is cached at its first use, so a
process sees one value throughout; "read at construction" switches are read when a runner
resolves its config.

================================  ==================================================  ==================
variable                          effect                                              read
================================  ==================================================  ==================
``TRITON_INTERPRET=1``            Triton kernels run in Triton's interpreter (CPU)    once (set it before
                                                                                      importing fullgraph)
``FULLGRAPH_CUDAGRAPH=MODE``      forces ``RunnerConfig.cudagraph`` (none/padded/full) at construction
``FULLGRAPH_COMPILE=0|1``         forces ``RunnerConfig.compile``                     at construction
``FULLGRAPH_PDL=0``               no programmatic dependent launch                    once
``FULLGRAPH_PDL=early``           the linears let the kernel behind start right after  once
                                  their wait (default ``late``: after their last
                                  weight tile)
``FULLGRAPH_COMPILE_WORKERS=N``   threads compiling Triton kernels ahead (0: off)     at each capture
``FULLGRAPH_STAGE_EVENT=WHERE``   where a step's graph records the event the host     once
                                  waits on before it rewrites the staging area:
                                  ``branch`` (the default: on a second stream beside
                                  the model's kernels, rejoined at the step's end) or
                                  ``inline`` (right after the stage-in, between it and
                                  the model's first kernel)
``FULLGRAPH_LINEAR=IMPL``         linears of 2-64 rows: ``timed`` (the default: on    once
                                  CUDA each captured size of 2-32 rows recorded with
                                  the split-K weight-streaming kernel, the decoder
                                  layer's norm, residual and RoPE + KV write fused
                                  into it, and with cuBLAS in the unfused flow; the
                                  graph faster over 1,024 cached tokens a row kept;
                                  cuBLAS for 33-64), ``auto`` (split-K for 2-32, not
                                  timed), ``skinny`` (split-K for 2-64), ``cublas``
                                  (2-64, the layer unfused) or ``triton`` (our tl.dot
                                  kernel)
``FULLGRAPH_FUSE=A,B``            decoder-layer fusions, default ``layer,rope``             once
                                  (``none``: off). In bf16/fp16 CUDA steps of 1-32
                                  rows (``FULLGRAPH_LINEAR``'s fused ones):
                                  ``layer`` (RMSNorm on load, residual add in the
                                  epilogue), ``rope`` (RoPE + KV write in the QKV
                                  projection); in decode steps: ``reduce`` (the split-KV
                                  merge in the attention launch; slower so far, opt-in);
                                  in one-row steps: ``layernorm`` (a LayerNorm applied on
                                  load, as ``layer`` applies an RMSNorm; opt-in: faster on
                                  an H100, slower on an H200 in its first configuration);
                                  ``head32`` (the LM head's GEMM writes float32 logits
                                  itself, no cast kernel; opt-in until timed)
================================  ==================================================  ==================
"""
from __future__ import annotations

import functools
import os

CUDAGRAPH = "FULLGRAPH_CUDAGRAPH"
COMPILE = "FULLGRAPH_COMPILE"
PDL = "FULLGRAPH_PDL"
COMPILE_WORKERS = "FULLGRAPH_COMPILE_WORKERS"
LINEAR = "FULLGRAPH_LINEAR"
FUSE = "FULLGRAPH_FUSE"
STAGE_EVENT = "FULLGRAPH_STAGE_EVENT"
FUSIONS = ("layer", "rope", "reduce", "layernorm", "head32")
DEFAULT_FUSIONS = "layer,rope"


def _flag(name: str) -> bool:
    """The one rule for on/off variables: set and not "" or "0"."""
    return os.environ.get(name, "0") not in ("", "0")


@functools.cache
def triton_interpret() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET``), read once."""
    return _flag("TRITON_INTERPRET")


@functools.cache
def pdl_disabled() -> bool:
    """``FULLGRAPH_PDL=0`` switches programmatic dependent launch off (read once)."""
    return os.environ.get(PDL, "1") == "0"


@functools.cache
def pdl_late() -> bool:
    """Whether linears start their dependents after their K loop (the default, ``late``) rather
    than right after their wait (``FULLGRAPH_PDL=early``); read once."""
    value = os.environ.get(PDL, "late")
    if value not in ("0", "1", "late", "early"):
        raise ValueError(f"{PDL}={value!r}: expected 0 (off), late (the default), early or 1 (= late)")
    return value != "early"


def cudagraph_override() -> str | None:
    """``FULLGRAPH_CUDAGRAPH``: a cudagraph mode forced on every runner, or None."""
    return os.environ.get(CUDAGRAPH) or None


def compile_override() -> str | None:
    """``FULLGRAPH_COMPILE``: "0" or "1" forced on every runner, or None."""
    return os.environ.get(COMPILE) or None


def compile_workers() -> int | None:
    """``FULLGRAPH_COMPILE_WORKERS``: threads for compiling kernels ahead, or None (the default)."""
    value = os.environ.get(COMPILE_WORKERS)
    if value is None:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{COMPILE_WORKERS}={value!r}: expected a number of threads (0 switches it off)") from None


@functools.cache
def linear_impl() -> str:
    """``FULLGRAPH_LINEAR``: which kernel serves linears of a few rows (read once)."""
    value = os.environ.get(LINEAR, "timed")
    if value not in ("auto", "timed", "triton", "skinny", "cublas"):
        raise ValueError(f"{LINEAR}={value!r}: expected timed (the default), auto, triton, skinny or cublas")
    return value


@functools.cache
def stage_event() -> str:
    """``FULLGRAPH_STAGE_EVENT``: ``inline`` or ``branch`` (read once)."""
    value = os.environ.get(STAGE_EVENT, "branch")
    if value not in ("inline", "branch"):
        raise ValueError(f"{STAGE_EVENT}={value!r}: expected branch (the default) or inline")
    return value


@functools.cache
def fused() -> frozenset[str]:
    """``FULLGRAPH_FUSE``: the decoder-layer fusions switched on (read once; unset: ``layer,rope``,
    ``none`` or empty: none)."""
    value = os.environ.get(FUSE, DEFAULT_FUSIONS)
    names = frozenset(n for n in value.split(",") if n and n != "none")
    if not names <= set(FUSIONS):
        raise ValueError(f"{FUSE}={os.environ[FUSE]!r}: expected a comma-separated subset of {FUSIONS}")
    return names
