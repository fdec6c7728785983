"""Compile the Triton kernel variants of a set of runs in parallel, before running any of them.

Triton compiles a kernel variant (one set of constexprs and argument specialisations) the first
time it is launched, on the launching thread: the first capture of a process on a machine with a
cold Triton cache compiled Phi-3-Small's 21 variants one after another (9.7 s of its 18-28 s).
Under :func:`compile_ahead` a launch of a :func:`kernel` only *submits* its variant's compilation
to a thread pool (Triton's ``AsyncCompileMode``: its compiler passes release the GIL and ``ptxas``
is a subprocess) and returns without running it; leaving the block waits for every compilation
and fills Triton's in-memory cache, so the real launches afterwards find their kernels ready.
Each compile job also builds the kernel's launcher (Triton 3.6 compiles a C launcher per
signature: 3 s of first loads for Phi-3-Small, serially, on a cold cache). Measured on an H200
(BENCHMARKS.md): Phi-3-Small's capture of 55 graphs on an empty Triton cache 22.1 s serially,
11.5 s compiled ahead; on a warm cache 9.4 s and 8.3 s.

A run under :func:`compile_ahead` launches none of these kernels, so everything they would write
keeps its old contents (the KV cache included) and their outputs (allocated by :func:`output`)
are zeros: it exists only to collect the variants. Shapes never depend on kernel outputs in a capture-safe step, so such a run
reaches every launch a real one does. Torch's own operators in it do run.

Off (a plain serial compile at the first launch, as Triton does) on CPU, under
``TRITON_INTERPRET``, on a Triton without ``AsyncCompileMode``, or with
``FULLGRAPH_COMPILE_WORKERS=0`` in the environment (``fullgraph.env``; read at each capture, a
number sets the pool size).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from .. import env

logger = logging.getLogger("fullgraph")

_active = False  # inside compile_ahead: launches of `kernel`s only submit their compilation
_submitted: set = set()  # (kernel, argument key) pairs submitted in the current compile_ahead block
# the last compile_ahead block: {"variants", "runs_s" (the runs, submitting), "wait_s" (leaving: the
# compilations still running), "jobs": [(kernel, start_s, compile_s, launcher_s), ...] (from the block's start)}
last: dict = {}


class Kernel:
    """A launched Triton kernel: ``kernel[grid](*args, **meta)`` launches it as Triton does, or,
    under :func:`compile_ahead`, submits the compilation of that variant and returns."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn  # the triton.jit function (an InterpretedFunction under TRITON_INTERPRET)

    def __getitem__(self, grid):
        if _active:
            return functools.partial(self._submit, grid)
        return self.fn[grid]

    def _submit(self, grid, *args, **kwargs) -> None:
        """Submit this variant once per block. Triton keys a variant on each tensor's dtype and
        16-byte alignment, each int's divisibility by 16 (and == 1), and the constexprs; the key
        here keeps whole scalar values, so it is finer (never merges two variants) and still
        matches across layers, which repeat every launch with other weights: without it, each of
        them (9,111 launches for Phi-3-Small's 55 keys) would pay Triton's variant hashing."""
        key = (self, tuple(map(_arg_key, args)), tuple((k, _arg_key(v)) for k, v in kwargs.items()))
        if key not in _submitted:
            _submitted.add(key)
            self.fn.warmup(*args, grid=grid, **kwargs)

    def __repr__(self) -> str:
        return f"compile_ahead.Kernel({self.fn!r})"


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return a


def output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor for a kernel's output: ``torch.empty``, except inside :func:`compile_ahead`,
    where the kernel only compiles and torch's operators after it would read its contents
    (compute-sanitizer's initcheck counted every such read): zeros there."""
    return (torch.zeros if _active else torch.empty)(shape, dtype=dtype, device=device)


def kernel(fn) -> Kernel:
    """Decorator over ``@triton.jit`` for every kernel a launcher launches (not for the
    ``@triton.jit`` helpers kernels call)."""
    return Kernel(fn)


def workers() -> int:
    """Threads :func:`compile_ahead` uses here: 0 when it is off (see the module docstring)."""
    if not torch.cuda.is_available() or env.triton_interpret() or not hasattr(triton, "AsyncCompileMode"):
        return 0
    configured = env.compile_workers()
    if configured is not None:
        return configured
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class _Pool(ThreadPoolExecutor):
    """A thread pool whose jobs also build each compiled kernel's launcher: on Tritons that
    generate and build a C launcher per kernel signature, that build (a C compiler run on a cold
    cache) would otherwise happen at the first real launch, serially."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_compile_and_prepare, fn, args, kwargs)


def _compile_and_prepare(fn, args, kwargs):
    start = time.perf_counter()
    compiled = fn(*args, **kwargs)
    built = time.perf_counter()
    try:  # best effort: the real first launch builds (or, now, loads) it again either way
        triton.runtime.driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 (an internal API of Triton's; a failure here changes nothing)
        pass
    name = getattr(getattr(compiled, "metadata", None), "name", "?")
    last.setdefault("jobs", []).append((name, start - last.get("t0", start), built - start, time.perf_counter() - built))
    return compiled


@contextlib.contextmanager
def compile_ahead(num_workers: int | None = None) -> Iterator[bool]:
    """Within the block, launches of :func:`kernel` kernels only submit their compilation; leaving
    it waits for them all (and raises the first compile error). Yields whether it is on: when off
    (``num_workers`` 0, or see ``workers()``), launches inside run normally, so callers should skip
    runs that exist only to collect variants."""
    global _active
    num_workers = workers() if num_workers is None else num_workers
    if num_workers <= 0 or _active:
        yield False
        return
    last.clear()
    last.update(t0=time.perf_counter(), jobs=[])
    with _Pool(num_workers, thread_name_prefix="fullgraph-jit") as pool, triton.AsyncCompileMode(pool):
        _active = True
        try:
            yield True
        finally:
            _active = False
            last["variants"] = len(_submitted)
            last["runs_s"] = time.perf_counter() - last["t0"]
            _submitted.clear()
    last["wait_s"] = time.perf_counter() - last["t0"] - last["runs_s"]


def compile_runs(runs: Iterable[Callable[[], None]], num_workers: int | None = None) -> float:
    """Call every run under :func:`compile_ahead`, so the Triton variants they launch compile in
    parallel; returns the seconds it took (0.0 when compiling ahead is off: nothing is called)."""
    start = time.perf_counter()
    with compile_ahead(num_workers) as active:
        if not active:
            return 0.0
        count = 0
        for run in runs:
            run()
            count += 1
    seconds = time.perf_counter() - start
    logger.info("fullgraph: compiled the Triton kernels of %d runs ahead in %.2f s (%d submissions; the runs "
                "%.2f s, then waiting %.2f s)", count, seconds, last.get("variants", 0), last.get("runs_s", 0.0),
                last.get("wait_s", 0.0))
    return seconds
