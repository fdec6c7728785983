"""Programmatic dependent launch (PDL, compute capability 9.0+): let a kernel start before the
one ahead of it in the stream has finished.

A decode step is a chain of short kernels; between two of them the GPU drains one grid and
launches the next, and a weight-streaming GEMM then waits a DRAM round trip for its first tile.
With PDL a kernel is launched with ``launch_pdl=True``; its programs may start once every program
of the kernel before it has called :func:`start_dependents` (or exited), and they block in
:func:`wait` until that kernel has finished and its writes are visible. Work placed before the
wait overlaps the previous kernel.

The contract every kernel here follows (so the chain stays correct transitively, including
across kernels launched without PDL, whose dependents simply start after they finish):

- before :func:`wait` a program reads only **model parameters** (weights, biases, norm scales),
  never activations, metadata, caches or workspaces, and writes nothing;
- every program calls :func:`wait` (a kernel that finishes before the one ahead of it would
  break the chain for the kernel behind it);
- :func:`start_dependents` comes right after the wait: the next kernel starts early enough to
  prefetch its weights while this one runs, and at most one kernel waits ahead.

Recorded by CUDA stream capture as programmatic graph edges, so captured steps keep it. Off on
CPU, under ``TRITON_INTERPRET``, before Hopper, on a Triton without ``gdc_wait``, or with
``FULLGRAPH_PDL=0`` in the environment (``fullgraph.env``, read once).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import env


@functools.cache
def _enabled(device_index: int) -> bool:
    if env.pdl_disabled() or env.triton_interpret():
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait") or not hasattr(cuda, "gdc_launch_dependents"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def options(t: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel with a ``USE_PDL`` constexpr on ``t``'s device."""
    if t.device.type == "cuda" and _enabled(t.device.index if t.device.index is not None
                                            else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def late() -> bool:
    """Whether a weight-streaming kernel lets the kernel behind it start only after its last weight
    tile (``FULLGRAPH_PDL=late``) instead of right after its wait: programs of the kernel behind
    that start early sit in their wait on SM slots the kernel's later waves could use."""
    return env.pdl_late()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Block until the kernel ahead has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_dependents(USE_PDL: tl.constexpr):
    """Allow the kernel behind this one to start (it still waits for this one to finish)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
