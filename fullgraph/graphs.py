"""CUDA-graph capture and replay mechanics: one shared pool, largest first, address guard."""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .kernels import compile_ahead

logger = logging.getLogger("fullgraph")

GraphKey = tuple[int, bool]  # (padded token count, decode-only)
# a key's candidate forms: (name, a context within which a run is that form), the default first
Variants = Sequence[tuple[str, Callable[[], AbstractContextManager]]]
MARGIN = 0.01  # another form replaces the default only when its replays are this much shorter


@dataclass(frozen=True)
class CaptureReport:
    num_graphs: int
    seconds: float
    graph_bytes: int          # device memory the graphs' pool took
    keys: tuple[GraphKey, ...]
    warmup_seconds: float = 0.0       # eager runs before each capture (serial Triton JIT happens here)
    record_seconds: float = 0.0       # running the step under stream capture
    instantiate_seconds: float = 0.0  # ending each capture: instantiating its graph
    compile_seconds: float = 0.0      # compiling every key's Triton kernels ahead, in parallel (kernels.compile_ahead)
    chosen: tuple[tuple[GraphKey, str, tuple[float, ...]], ...] = ()  # keys captured in several forms: the
    #                                   form kept and every form's replay ms, in the order they were offered
    choose_seconds: float = 0.0       # capturing the other forms of those keys and timing them all

    def __str__(self) -> str:
        text = (f"captured {self.num_graphs} graphs in {self.seconds:.2f} s (Triton kernels compiled ahead "
                f"{self.compile_seconds:.2f} s, warm-up runs {self.warmup_seconds:.2f} s, recording "
                f"{self.record_seconds:.2f} s, instantiation {self.instantiate_seconds:.2f} s), "
                f"{self.graph_bytes / 2**20:.1f} MiB of graph memory")
        if self.chosen:
            forms = ", ".join(f"{key[0]}{'' if key[1] else ' mixed'}: {name} "
                              f"({' / '.join(f'{t:.3f}' for t in times)} ms)" for key, name, times in self.chosen)
            text += f"; timed at capture ({self.choose_seconds:.2f} s): {forms}"
        return text


def pick(times: Sequence[float], margin: float = MARGIN) -> int:
    """Which of several forms' replay times to keep: the first (the default) unless another's is
    shorter by more than ``margin`` of it, then the shortest (a near tie keeps the default, so the
    choice does not flip between processes on noise)."""
    best = min(range(len(times)), key=times.__getitem__)
    return best if times[best] < times[0] * (1 - margin) else 0


class AddressMovedError(RuntimeError):
    """A tensor a captured graph reads was re-allocated after capture."""


class GraphSet:
    """The captured graphs of one runner, keyed by ``GraphKey``.

    ``capture`` first runs ``prepare(key)`` (fills the static buffers with a capture plan) and
    ``run(key)`` for every key under ``kernels.compile_ahead.compile_ahead``, so the Triton variants of all
    keys compile in parallel; then, key by key, ``prepare``, ``run`` eagerly ``warmups`` times
    outside capture, and once under stream capture on a side stream into the shared pool. Garbage collection is
    off during capture so no tensor is freed (or its memory reused) mid-capture.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None  # the side stream every capture runs on
        self._addresses: dict[str, int] = {}
        self.forms: dict[GraphKey, str] = {}  # the form each key captured with forms was kept in

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.graphs

    def capture(self, keys: Sequence[GraphKey], prepare: Callable[[GraphKey], None],
                run: Callable[[GraphKey], None], addresses: Callable[[], dict[str, int]],
                warmups: int = 1, variants: Callable[[GraphKey], Variants] | None = None,
                timing: Callable[[GraphKey], None] | None = None) -> CaptureReport:
        """``variants(key)``: the forms a key's step may take; the first is captured (within its
        context) as a key without forms is; where there are more, each other is captured after a
        warm-up run of its own, their replays are timed against each other and the fastest is kept
        (:func:`pick`), the others' graphs dropped, their memory back in the pool for the smaller
        keys. ``timing(key)`` fills the buffers with the step the forms are timed on (default: the
        capture step, which reads next to nothing of the cache); ``prepare`` then runs again.
        ``self.forms`` names each key's form, as soon as it is known (keys come largest first, a
        size's decode-only key before its mixed one)."""
        keys = sorted(keys, reverse=True)  # largest first: smaller graphs reuse its pool blocks
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # once, so the reserved-memory difference below is the graphs'
        reserved0, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        gc.collect()
        gc.disable()
        phases = [0.0, 0.0, 0.0]  # warm-up, recording, instantiation
        chosen, choosing = [], 0.0
        try:
            compiled = compile_ahead.compile_runs((lambda k=k: (prepare(k), run(k))) for k in keys)
            for i, key in enumerate(keys):
                forms = variants(key) if variants is not None else ()
                with forms[0][1]() if forms else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    prepare(key)
                    for _ in range(warmups + (i == 0)):
                        run(key)
                    torch.cuda.synchronize(self.device)
                    t1 = time.perf_counter()
                    self.graphs[key], recording = self._record(run, key)
                phases[0] += t1 - t0
                phases[1] += recording
                phases[2] += time.perf_counter() - t1 - recording
                if len(forms) > 1:
                    t2 = time.perf_counter()
                    name, times = self._choose(key, forms, run, warmups, timing, prepare)
                    self.forms[key] = name
                    chosen.append((key, name, times))
                    choosing += time.perf_counter() - t2
                elif forms:
                    self.forms[key] = forms[0][0]
                if (i + 1) % 16 == 0 or i + 1 == len(keys):
                    logger.info("capture: %d/%d graphs (%.1f s)", i + 1, len(keys), time.perf_counter() - start)
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up runs' cached blocks; the graphs' pool stays
        self._addresses = addresses()
        return CaptureReport(len(keys), time.perf_counter() - start,
                             torch.cuda.memory_reserved(self.device) - reserved0, tuple(keys), *phases, compiled,
                             tuple(chosen), choosing)

    def _choose(self, key: GraphKey, forms: Variants, run: Callable[[GraphKey], None], warmups: int,
                timing: Callable[[GraphKey], None] | None = None,
                prepare: Callable[[GraphKey], None] | None = None) -> tuple[str, tuple[float, ...]]:
        """Capture ``key`` in each of ``forms`` after the first (already in ``self.graphs``), time
        them all (on the step ``timing`` fills the buffers with, then ``prepare`` again), keep the
        fastest graph; returns its name and every form's replay ms. A form that cannot run or be
        captured is logged and left out (its time ``inf``): the first one stands."""
        graphs, names = [self.graphs[key]], [forms[0][0]]
        for name, context in forms[1:]:
            try:
                with context():
                    for _ in range(warmups):
                        run(key)
                    torch.cuda.synchronize(self.device)
                    graphs.append(self._record(run, key)[0])
                    names.append(name)
            except Exception as err:  # noqa: BLE001 (an alternative's failure leaves the default, named)
                logger.warning("fullgraph: the %r form of graph %s could not be captured (%s: %s); keeping %r",
                               name, key, type(err).__name__, err, forms[0][0])
        if timing is not None:
            timing(key)
        measured = dict(zip(names, self._replay_ms(graphs)))
        if timing is not None and prepare is not None:
            prepare(key)
        times = [measured.get(name, float("inf")) for name, _ in forms]
        best = pick(times)
        self.graphs[key] = graphs[names.index(forms[best][0])]  # the others are freed on return
        return forms[best][0], tuple(times)

    def _replay_ms(self, graphs: Sequence[torch.cuda.CUDAGraph], rounds: int = 5, replays: int = 8) -> list[float]:
        """Each graph's shortest mean replay (ms) over ``rounds`` of ``replays`` back-to-back replays,
        the graphs taking turns (a clock or a neighbour's drift hits all of them alike)."""
        for graph in graphs:  # a first replay of each: lazy loads, the allocator's first touch
            graph.replay()
        best = [float("inf")] * len(graphs)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
        for _ in range(rounds):
            for i, graph in enumerate(graphs):
                events[i][0].record()
                for _ in range(replays):
                    graph.replay()
                events[i][1].record()
            torch.cuda.synchronize(self.device)
            for i, (begin, end) in enumerate(events):
                best[i] = min(best[i], begin.elapsed_time(end) / replays)
        return best

    def _record(self, run: Callable[[GraphKey], None], key: GraphKey) -> tuple[torch.cuda.CUDAGraph, float]:
        """Capture one run of ``key`` on the side stream into the shared pool; returns the graph
        and the seconds spent recording (the rest of the call is instantiation).

        ``torch.cuda.graph()`` would also empty the allocator's cache before every capture, so
        each next warm-up run pays ``cudaMalloc`` again: half of a warm capture's time for
        Phi-3-Small (BENCHMARKS.md). Here the cache is emptied once, after the last graph.
        """
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            start = time.perf_counter()
            graph.capture_begin(pool=self._pool)
            try:
                run(key)
                recording = time.perf_counter() - start
            finally:
                graph.capture_end()  # instantiates the graph
        current.wait_stream(self._stream)
        torch.cuda.synchronize(self.device)
        return graph, recording

    def replay(self, key: GraphKey) -> None:
        self.graphs[key].replay()

    def check_addresses(self, current: dict[str, int]) -> None:
        """Raise if any tensor the graphs read has moved since capture."""
        moved = [name for name, ptr in self._addresses.items() if current.get(name) != ptr]
        if moved:
            raise AddressMovedError(
                f"tensors captured by the CUDA graphs were re-allocated after capture: {moved}; "
                "the graphs would read stale memory. Copy new data into the existing tensors "
                "(tensor.copy_) instead of replacing them, or call runner.capture() again")
