"""What one host call costs on this machine: the calls a decode step's host work is made of.

    python benchmarks/host_calls.py [--iters 20000] [--out host_calls.json]

A decode step's host stages (``bench host``) cost several times more on the GPU machine than on
a 2-core CPU VM. This separates the kinds of call they are made of: the Python interpreter alone,
small numpy operations, the clock, PyTorch's dispatcher on CPU tensors, and (on CUDA) the CUDA
calls a step makes: an allocation, an asynchronous host-to-device copy, an event record, a tiny
kernel launch, a graph replay of one kernel, a stream synchronisation; numpy reads and writes of
pinned memory (the staging area a step is planned into) against pageable memory; and a small
workload timed right after a synchronisation that waited, against the same workload warm. Median microseconds per call
over ``--iters`` calls (in batches of 100, so the clock's own cost is spread). Prints a table and,
given ``--out``, writes JSON; nothing asserts on time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch


def per_call_us(fn, iters: int, batch: int = 100) -> float:
    """Median over batches of ``batch`` back-to-back calls, microseconds per call."""
    for _ in range(batch):
        fn()
    samples = []
    for _ in range(max(1, iters // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(samples)


def cases() -> dict:
    small = np.arange(8, dtype=np.int64)
    table = np.arange(64 * 68, dtype=np.int32).reshape(64, 68)
    rows = np.arange(64)
    cpu = torch.zeros(8, dtype=torch.int64)
    out = {
        "python: empty function call": lambda: None,
        "python: dict + list work (20 ops)": lambda: [{"a": i, "b": i * 2}["b"] for i in range(5)],
        "time.perf_counter()": time.perf_counter,
        "numpy: small add": lambda: small + 1,
        "numpy: count_nonzero": lambda: np.count_nonzero(small),
        "numpy: fancy-index gather (64 x 68 table)": lambda: table[rows, rows % 68],
        "torch CPU: small add": lambda: cpu + 1,
        "torch CPU: torch.from_numpy": lambda: torch.from_numpy(small),
    }
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        host = torch.zeros(4096, dtype=torch.int32).pin_memory()
        buf = torch.zeros(4096, dtype=torch.int32, device=dev)
        x = torch.zeros(8, device=dev)
        event = torch.cuda.Event()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            x.add_(1)
        torch.cuda.synchronize()
        out.update({
            "cuda: torch.empty(8) (caching allocator)": lambda: torch.empty(8, device=dev),
            "cuda: 16 KB pinned host-to-device copy_, non_blocking": lambda: buf.copy_(host, non_blocking=True),
            "cuda: event.record()": event.record,
            "cuda: torch.cuda.current_stream()": torch.cuda.current_stream,
            "cuda: tiny kernel (x.add_(1))": lambda: x.add_(1),
            "cuda: graph.replay() of one kernel": graph.replay,
            "cuda: torch.cuda.synchronize() (idle GPU)": torch.cuda.synchronize,
        })
        # the staging area a step is planned into is pinned host memory: is it slower for numpy?
        for label, mem in (("pageable", torch.zeros(16384, dtype=torch.int32)),
                           ("pinned", torch.zeros(16384, dtype=torch.int32).pin_memory())):
            a = mem.numpy()
            out.update({
                f"numpy: write 64 KB into {label} memory": lambda a=a: a.fill(3),
                f"numpy: sum 64 KB of {label} memory": lambda a=a: a.sum(),
                f"numpy: write 64 ints into {label} memory": lambda a=a: a.__setitem__(slice(0, 64), 5),
                f"numpy: gather 64 ints from {label} memory": lambda a=a: a[rows * 68],
            })
    return out


def after_wait_us(iters: int = 300) -> tuple[float, float]:
    """The same small host workload (a few hundred Python and numpy operations) timed right after
    ``torch.cuda.synchronize()`` returned from a ~1 ms wait, and timed warm (the previous run's
    end): whether a thread that waited for the GPU resumes slowly."""
    table = np.arange(64 * 68, dtype=np.int32).reshape(64, 68)

    def work():
        acc = 0
        for i in range(40):
            acc += int(table[i, i % 68]) + len({"a": i, "b": acc})
        return acc

    cold, warm = [], []
    for _ in range(iters):
        torch.cuda._sleep(1_500_000)  # about 1 ms of GPU clock cycles
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        mid = time.perf_counter()
        work()
        cold.append(mid - start)
        warm.append(time.perf_counter() - mid)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    for name, fn in cases().items():
        us = per_call_us(fn, args.iters)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows.append({"call": name, "us": us})
        print(f"{name:48s} {us:9.3f} us", flush=True)
    if torch.cuda.is_available():
        cold, warm = after_wait_us()
        for name, us in (("workload right after a 1 ms synchronize()", cold), ("the same workload again", warm)):
            rows.append({"call": name, "us": us})
            print(f"{name:48s} {us:9.3f} us", flush=True)
    if args.out:
        info = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                "machine": platform.machine(), "processor": platform.processor(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
