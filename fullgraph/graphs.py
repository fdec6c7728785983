"""CUDA-graph capture and replay mechanics: one shared pool, largest first, address guard."""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("fullgraph")

GraphKey = tuple[int, bool]  # (padded token count, decode-only)


@dataclass(frozen=True)
class CaptureReport:
    num_graphs: int
    seconds: float
    graph_bytes: int          # device memory the graphs' pool took
    keys: tuple[GraphKey, ...]

    def __str__(self) -> str:
        return (f"captured {self.num_graphs} graphs in {self.seconds:.2f} s, "
                f"{self.graph_bytes / 2**20:.1f} MiB of graph memory")


class AddressMovedError(RuntimeError):
    """A tensor a captured graph reads was re-allocated after capture."""


class GraphSet:
    """The captured graphs of one runner, keyed by ``GraphKey``.

    ``capture`` runs ``prepare(key)`` (fills the static buffers with a capture plan), then
    ``run(key)`` eagerly ``warmups`` times outside capture (Triton JIT / autotuning happen there),
    then once inside ``torch.cuda.graph`` with the shared pool. Garbage collection is off during
    capture so no tensor is freed (or its memory reused) mid-capture.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._addresses: dict[str, int] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.graphs

    def capture(self, keys: Sequence[GraphKey], prepare: Callable[[GraphKey], None],
                run: Callable[[GraphKey], None], addresses: Callable[[], dict[str, int]],
                warmups: int = 1) -> CaptureReport:
        keys = sorted(keys, reverse=True)  # largest first: smaller graphs reuse its pool blocks
        torch.cuda.synchronize(self.device)
        reserved0, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        gc.collect()
        gc.disable()
        try:
            for i, key in enumerate(keys):
                prepare(key)
                for _ in range(warmups + (i == 0)):
                    run(key)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    run(key)
                self.graphs[key] = graph
                if (i + 1) % 16 == 0 or i + 1 == len(keys):
                    logger.info("capture: %d/%d graphs (%.1f s)", i + 1, len(keys), time.perf_counter() - start)
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        self._addresses = addresses()
        return CaptureReport(len(keys), time.perf_counter() - start,
                             torch.cuda.memory_reserved(self.device) - reserved0, tuple(keys))

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
